"""Engine stress: over a thousand requests through ONE Engine per mode.

Requests arrive over time (a random number between steps) with random prompt lengths and small
random max_tokens; prompts often repeat or share a prefix (prefix caching); live requests are
aborted at random, whether queued, running or preempted; about one submission in ten is bad (too
long for the model, token ids out of range or not ints, an empty prompt, bad SamplingParams
fields, params of the wrong type, a request the page pool can never hold). The page pool is
small, so the scheduler preempts.

Checked: every bad request raises ValueError naming its problem and leaves the engine as it
was; every good request that is not aborted finishes exactly once (none lost, none duplicated,
nothing reported after its finish or its abort); its streamed deltas add up to its final output;
its greedy output is the target's greedy continuation (argmax over one fresh full forward of the
whole sequence, independent of the runner, the paged caches and the scheduler), and a random
sample of requests, preempted ones first, gives the same tokens when run alone on a fresh
Decoder of the same mode; preemptions and prefix-cache hits did happen; at the end both block
managers have every page back in the free pool with reference count 0.

Bounded: a step cap, a stall detector and a wall-clock cap each fail the test with a message
instead of letting it hang.
"""
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from tests.support.helpers import full_forward_logits

N_GOOD = 1200            # good requests per mode (the bad ones come on top)
BAD_SHARE = 0.10         # share of submissions that are bad
MAX_PROMPT, MAX_NEW = 40, 8
ARRIVALS_PER_STEP = 4    # up to this many submissions between two steps
ABORT_PROB = 0.12        # chance per step of aborting one live request
PAGE_SIZE = 4
# 40 pages of 4 tokens for up to 16 sequences of up to 40 + 8 positions (+ drafts): preemption
# is routine, yet the largest good request (52-53 positions = 14 pages) always fits alone.
ENGINE = dict(num_pages=40, max_num_seqs=16, max_num_batched_tokens=128, chunk_size=16)
N_ALONE = 40             # requests re-run alone on a fresh Decoder, per mode

MAX_STEPS = 15_000       # ~1 step per good request is typical
STALL_STEPS = 400        # steps in a row with live requests but no output at all
WALL_S = 300.0           # the engine loop, per mode (typically 15-30 s)

GREEDY = dict(temperature=0, ignore_eos=True)  # ignore_eos: every output is max_tokens long


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny models gain nothing from intra-op threads, and with the 2 CPU cores shared by
    other processes OpenMP's spinning threads make every step about ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the workload ----------------------------------------------------------------------------


@dataclass
class Bad:
    kind: str
    prompt: object
    make_params: Callable[[], object]  # called inside pytest.raises: SamplingParams checks its
    match: str                         # fields when built, the engine the rest in add_request


def _bad_request(rng, vocab, max_len, pool_tokens) -> Bad:
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
    kind = rng.choice(["too_long", "token_out_of_range", "token_not_int", "empty_prompt",
                       "bad_sampling_field", "stop_id_out_of_vocab", "params_not_sampling",
                       "never_fits_pool"])
    greedy = lambda: SamplingParams(max_tokens=3, **GREEDY)  # noqa: E731
    if kind == "too_long":
        long = [rng.randrange(vocab) for _ in range(rng.randint(max_len, max_len + 64))]
        return Bad(kind, long, greedy, "max_position_embeddings")
    if kind == "token_out_of_range":
        ids[rng.randrange(len(ids))] = rng.choice([-1, vocab, vocab + 7, 10**9])
        return Bad(kind, ids, greedy, rf"token ids must lie in \[0, {vocab}\)")
    if kind == "token_not_int":
        ids[rng.randrange(len(ids))] = rng.choice([1.0, True, "7", None])
        return Bad(kind, ids, greedy, "prompt must be a str or a list of int token ids")
    if kind == "empty_prompt":
        return Bad(kind, [], greedy, "empty")
    if kind == "bad_sampling_field":
        name, value = rng.choice([("temperature", -0.5), ("temperature", float("nan")),
                                  ("temperature", 1e-4), ("top_p", 0.0), ("top_p", 1.5),
                                  ("top_k", -2), ("max_tokens", 0), ("max_tokens", -1),
                                  ("max_tokens", 2.0), ("seed", -1), ("stop_token_ids", [-3])])
        return Bad(kind, ids, lambda: SamplingParams(**{name: value}), rf"SamplingParams\.{name}")
    if kind == "stop_id_out_of_vocab":
        stop = vocab + rng.randrange(100)
        return Bad(kind, ids, lambda: SamplingParams(max_tokens=3, stop_token_ids=[stop], **GREEDY),
                   "stop_token_ids must lie in")
    if kind == "params_not_sampling":
        return Bad(kind, ids, lambda: {"max_tokens": 3, "temperature": 0},
                   "params must be a SamplingParams")
    # Valid for the model (shorter than its context) but more pages than the whole pool.
    big = [rng.randrange(vocab) for _ in range(rng.randint(pool_tokens, max_len - 1))]
    return Bad(kind, big, greedy, "pages")


def _workload(seed, vocab, max_len, pool_tokens) -> list:
    """N_GOOD good submissions (prompt, max_tokens) with bad ones (Bad) mixed in. Half of the good
    prompts repeat a recent "hot" prompt exactly or extend a prefix of one, so that full pages
    are found in the prefix cache."""
    rng = random.Random(seed)
    hot, subs, n_good = [], [], 0
    while n_good < N_GOOD:
        if rng.random() < BAD_SHARE:
            subs.append(_bad_request(rng, vocab, max_len, pool_tokens))
            continue
        r = rng.random()
        if hot and r < 0.3:
            prompt = list(rng.choice(hot))
        elif hot and r < 0.5:
            base = rng.choice(hot)
            prompt = base[:rng.randint(1, len(base))]
            prompt += [rng.randrange(vocab) for _ in range(rng.randint(0, MAX_PROMPT - len(prompt)))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, MAX_PROMPT))]
            if len(hot) < 24:
                hot.append(prompt)
            else:
                hot[rng.randrange(len(hot))] = prompt
        subs.append((prompt, rng.randint(1, MAX_NEW)))
        n_good += 1
    return subs


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter(tiny_drafters):
    return tiny_drafters("vanilla", 4)  # a sequential (Markov) head: "dspark" mode uses it


@pytest.fixture(scope="module")
def reference_target(tiny_target):
    """The target alone, float64, for the full-forward greedy reference."""
    return Decoder.from_pretrained(tiny_target, mode="ar", dtype="float64").target


@pytest.fixture(scope="module")
def verified():
    """prompt + output sequences already checked against the full forward (shared by the modes:
    the workload is the same, so most outputs repeat)."""
    return set()


# -- checks ----------------------------------------------------------------------------------


def _engine_state(eng):
    """Everything a refused request must leave untouched."""
    s = eng.scheduler
    return (tuple(eng.requests), tuple(r.request_id for r in s.waiting),
            tuple(r.request_id for r in s.running), s.num_preemptions,
            tuple((bm.num_free, bm.num_evictable, bm.num_seqs) for bm in _block_managers(eng)))


def _block_managers(eng):
    return [bm for bm in (eng.target_blocks, eng.drafter_blocks) if bm is not None]


def _assert_greedy(target, prompt, tokens, verified, what):
    """tokens is the greedy continuation of prompt iff every token is the argmax of the target's
    logits given the prompt and the tokens before it: one causal forward over prompt + tokens[:-1]
    (teacher forcing) checks all of them at once."""
    key = tuple(prompt) + tuple(tokens)
    if key in verified:
        return
    seq = list(prompt) + list(tokens[:-1])
    with torch.inference_mode():
        logits = full_forward_logits(target, seq)[len(prompt) - 1:]
    best = logits.argmax(-1).tolist()
    if best != list(tokens):
        j = next(i for i, (a, b) in enumerate(zip(best, tokens)) if a != b)
        top2 = logits[j].topk(2).values.tolist()
        pytest.fail(f"{what}: output {tokens} is not the greedy continuation {best} of prompt "
                    f"{prompt}: first differs at token {j} (top-2 logits there {top2})")
    verified.add(key)


def _abort_one(eng, rng, aborted, finished):
    """Aborts a random live request and checks the abort API. The queue is picked first (the
    waiting queue is much longer than the running one): running, waiting, or preempted (back in
    the waiting queue with output, not yet resumed)."""
    s = eng.scheduler
    queues = {"running": [r.request_id for r in s.running],
              "preempted": [r.request_id for r in s.waiting if r.output_ids],
              "waiting": [r.request_id for r in s.waiting if not r.output_ids]}
    where = rng.choice([k for k, v in queues.items() if v])
    victim = rng.choice(queues[where])
    assert eng.abort(victim) is True
    assert victim not in s and victim not in eng.requests
    assert eng.abort(victim) is False, "a second abort of the same request must be a no-op"
    aborted[victim] = where
    if finished and rng.random() < 0.2:  # aborting a finished request does nothing either
        assert eng.abort(rng.choice(sorted(finished))) is False


# -- the test --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dspark", "dflash", "dspark-auto"])
def test_thousands_of_requests(tiny_target, drafter, reference_target, verified, mode):
    policy = "fixed"
    if mode == "dspark-auto":  # mostly plain rounds with deferred drafter context, exploring
        from dspark_rt.policies import AutoPolicy  # with half the batch one round in three
        from dspark_rt.policies.sps import SPSProfile
        spec = SPSProfile([2 ** i for i in range(12)], [2 ** (-i / 2) for i in range(12)])
        policy = AutoPolicy(spec, spec.scaled(3.0), explore_every=3, explore_share=0.5)
    dec = Decoder.from_pretrained(tiny_target, drafter, mode=mode.split("-")[0], dtype="float64",
                                  page_size=PAGE_SIZE, policy=policy)
    assert dec.mode == mode.split("-")[0] and (dec.mode != "dspark" or dec.drafter.head != "none")
    eng = dec.new_engine(**ENGINE)
    vocab, max_len = dec.target.config.vocab_size, dec.max_model_len
    pool_tokens = ENGINE["num_pages"] * PAGE_SIZE
    assert pool_tokens < max_len  # else "never_fits_pool" requests could not exist
    work = _workload(2024, vocab, max_len, pool_tokens)  # the same requests for every mode
    rng = random.Random(f"{mode}-events")                # arrivals and aborts

    # Watch the scheduler (observation only): preemptions, and admissions that start on pages
    # found in the prefix cache (their first chunk skips target positions).
    seen = Counter()
    preempted_ids = set()
    real_schedule = eng.scheduler.schedule

    def schedule():
        was_running = {r.request_id for r in eng.scheduler.running}
        out = real_schedule()
        for r in out.preempted:
            seen["preempted"] += 1
            seen["preempted_with_output"] += bool(r.output_ids)
            preempted_ids.add(r.request_id)
        for c in out.prefills:
            if c.req.request_id not in was_running:
                seen["admitted"] += 1
                seen["prefix_hit"] += c.target_from > 0
        return out

    eng.scheduler.schedule = schedule

    submitted = {}                   # rid -> (prompt, max_tokens)
    deltas = defaultdict(list)       # rid -> tokens streamed so far
    finished = {}                    # rid -> RequestOutput
    aborted = {}                     # rid -> where it was when aborted
    bad_kinds = Counter()
    next_sub, steps, idle, t0 = 0, 0, 0, time.monotonic()

    while next_sub < len(work) or eng.has_unfinished():
        # -- arrivals
        for _ in range(rng.randint(0, ARRIVALS_PER_STEP)):
            if next_sub == len(work):
                break
            sub, next_sub = work[next_sub], next_sub + 1
            if isinstance(sub, Bad):
                before = _engine_state(eng)
                with pytest.raises(ValueError, match=sub.match):
                    eng.add_request(sub.prompt, sub.make_params())
                assert _engine_state(eng) == before, f"a refused {sub.kind} request changed the engine"
                bad_kinds[sub.kind] += 1
                continue
            prompt, n = sub
            rid = eng.add_request(list(prompt), SamplingParams(max_tokens=n, **GREEDY))
            assert rid not in submitted, f"request id {rid} handed out twice"
            submitted[rid] = (prompt, n)
        # -- aborts
        if eng.requests and rng.random() < ABORT_PROB:
            _abort_one(eng, rng, aborted, finished)
        # -- one step
        outs = eng.step()
        steps += 1
        for o in outs:
            rid = o.request_id
            assert rid in submitted, f"step {steps}: output for unknown request {rid}"
            assert rid not in aborted, f"step {steps}: request {rid} produced output after its abort"
            assert rid not in finished, f"step {steps}: request {rid} reported after it finished"
            assert o.error is None, f"request {rid} failed: {o.error}"
            deltas[rid].extend(o.new_token_ids)
            assert len(deltas[rid]) <= submitted[rid][1], f"request {rid} exceeded max_tokens"
            if o.finished:
                assert o.output is not None, f"request {rid} finished without its RequestOutput"
                finished[rid] = o.output
            else:
                assert o.new_token_ids and o.output is None, f"empty or early output for {rid}"
        for bm in _block_managers(eng):
            bm.check()
        # -- bounded in time
        idle = 0 if outs or not eng.has_unfinished() else idle + 1
        why = (f"engine stalled: {idle} steps without any output" if idle >= STALL_STEPS else
               f"step cap {MAX_STEPS} reached" if steps >= MAX_STEPS else
               f"wall-clock cap {WALL_S:.0f} s exceeded" if time.monotonic() - t0 > WALL_S else None)
        if why:
            pytest.fail(f"{why} (mode {mode}, step {steps}, {time.monotonic() - t0:.0f} s, "
                        f"{len(submitted)} submitted, {len(finished)} finished, "
                        f"{len(aborted)} aborted, {len(eng.scheduler.waiting)} waiting, "
                        f"{len(eng.scheduler.running)} running)")
    loop_s = time.monotonic() - t0

    # -- the workload really was a stress (else the checks below prove little)
    assert len(submitted) == N_GOOD and sum(bad_kinds.values()) >= N_GOOD * BAD_SHARE / 2
    assert len(bad_kinds) == 8, f"bad kinds not all tried: {dict(bad_kinds)}"
    assert eng.scheduler.num_preemptions == seen["preempted"], "preemption counts disagree"
    assert seen["preempted"] > 50, f"too few preemptions for a stress test: {dict(seen)}"
    assert seen["preempted_with_output"] > 10, f"no preempted request had output yet: {dict(seen)}"
    assert seen["prefix_hit"] > 50, f"too few prefix-cache hits: {dict(seen)}"
    where_aborted = Counter(aborted.values())
    assert len(aborted) > 30, f"too few aborts: {dict(where_aborted)}"
    assert all(where_aborted[k] for k in ("waiting", "running", "preempted")), dict(where_aborted)

    # -- none lost, none duplicated
    assert not eng.has_unfinished() and not eng.requests
    assert not eng.scheduler.waiting and not eng.scheduler.running
    assert set(finished).isdisjoint(aborted)
    lost = set(submitted) - set(finished) - set(aborted)
    assert not lost, f"{len(lost)} requests never finished, e.g. {sorted(lost)[:10]}"

    # -- every page back in the free pool (cached pages count: ref 0, evictable)
    for bm in _block_managers(eng):
        bm.check()
        held = [p for p in range(bm.num_pages) if bm.ref_count(p)]
        assert not held, f"[{bm.name}] pages still referenced at the end: {held}"
        assert bm.num_used == 0 and bm.num_free == bm.num_pages == ENGINE["num_pages"]
        assert bm.num_seqs == 0, f"[{bm.name}] {bm.num_seqs} block tables left"

    # -- outputs: deltas add up, lengths, and the greedy continuation
    by_prompt = defaultdict(list)  # prompt -> (rid, tokens) of finished and aborted requests
    for rid, out in finished.items():
        prompt, n = submitted[rid]
        assert deltas[rid] == out.token_ids, f"request {rid}: deltas {deltas[rid]} != {out.token_ids}"
        assert out.request_id == rid and out.prompt_token_ids == prompt
        assert len(out.token_ids) == n and out.finish_reason == "length", (rid, out)
        by_prompt[tuple(prompt)].append((rid, out.token_ids))
    for rid in aborted:  # what an aborted request streamed before its abort must be right too
        if deltas[rid]:
            by_prompt[tuple(submitted[rid][0])].append((rid, deltas[rid]))
    for prompt, outs in by_prompt.items():
        # Greedy outputs of one prompt are prefixes of each other: check the longest one against
        # the full forward, and the others against it.
        longest = max((t for _, t in outs), key=len)
        _assert_greedy(reference_target, list(prompt), longest, verified, f"mode {mode}")
        for rid, toks in outs:
            assert toks == longest[:len(toks)], f"request {rid}: {toks} vs {longest} (same prompt)"

    # -- a sample run alone on a fresh Decoder of the same mode, preempted requests first
    alone = Decoder.from_pretrained(tiny_target, drafter, mode=dec.mode, dtype="float64",
                                    page_size=PAGE_SIZE)
    done_preempted = sorted(preempted_ids & set(finished))
    sample = rng.sample(done_preempted, min(N_ALONE // 2, len(done_preempted)))
    rest = sorted(set(finished) - set(sample))
    sample += rng.sample(rest, N_ALONE - len(sample))
    for rid in sample:
        prompt, n = submitted[rid]
        got = alone.generate([prompt], SamplingParams(max_tokens=n, **GREEDY), use_tqdm=False)[0]
        assert got.token_ids == finished[rid].token_ids, f"request {rid} alone: prompt {prompt}"
    print(f"\n{mode}: {steps} steps, engine loop {loop_s:.1f} s, {len(finished)} finished, "
          f"{len(aborted)} aborted {dict(where_aborted)}, bad {dict(bad_kinds)}, {dict(seen)}")


@pytest.mark.parametrize("name,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0)])
def test_params_changed_after_construction_are_refused(tiny_target, name, value):
    """SamplingParams checks its fields when built; a field set afterwards is just as bad and
    is refused by add_request too (unchecked, max_tokens=0 would return one token and
    temperature=-1 would sample)."""
    eng = Decoder.from_pretrained(tiny_target, mode="ar", dtype="float64").new_engine(num_pages=16)
    params = SamplingParams(max_tokens=3, **GREEDY)
    setattr(params, name, value)
    with pytest.raises(ValueError, match=name):
        eng.add_request([1, 2, 3], params)
