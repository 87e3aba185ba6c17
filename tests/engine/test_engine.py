"""Continuous batching: requests arriving and leaving between rounds, preemption under page
pressure, aborts, bad requests, NaN logits, streaming; greedy outputs equal plain decoding."""
import random

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.engine import EngineConfig
from dspark_rt.runner.round import Round

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_target, tiny_drafters):
    return tiny_target, tiny_drafters("vanilla", 4)


def _alone(target, prompt, max_tokens):
    dec = Decoder.from_pretrained(target, mode="ar", dtype="float64")
    return dec.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("mode,num_pages", [("dspark", 400), ("dspark", 14), ("ar", 10), ("dflash", 14)])
def test_stress_equals_requests_run_alone(pair, mode, num_pages):
    """Requests of random lengths arrive over time, some are aborted, some are bad; with few
    pages the scheduler must preempt. Every good request finishes with the tokens it gets alone,
    none is lost or duplicated, and every page is back in the pool at the end."""
    target, drafter = pair
    rng = random.Random(1234 + num_pages)
    dec = Decoder.from_pretrained(target, None if mode == "ar" else drafter, mode=mode, dtype="float64",
                                  page_size=4)
    eng = dec.new_engine(num_pages=num_pages, max_num_seqs=6, max_num_batched_tokens=48, chunk_size=8)
    want, done, aborted, bad = {}, {}, set(), 0
    pending = [([rng.randrange(90) for _ in range(rng.randint(1, 20))], rng.randint(1, 12)) for _ in range(30)]
    steps = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt, n = pending.pop()
                rid = eng.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))
                want[rid] = (prompt, n)
        if rng.random() < 0.3:  # a bad request is refused alone
            with pytest.raises(ValueError):
                eng.add_request([rng.choice([-1, 10**6])], SamplingParams(max_tokens=2))
            bad += 1
        live = list(eng.requests)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert eng.abort(victim)
            aborted.add(victim)
        for o in eng.step():
            assert o.request_id not in done, "a request finished twice"
            if o.finished:
                assert o.error is None
                done[o.request_id] = o.output.token_ids
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    assert set(done) | aborted == set(want) and not (set(done) & aborted)
    for rid, toks in done.items():
        prompt, n = want[rid]
        assert toks == _alone(target, prompt, n), f"request {rid} prompt {prompt}"
    assert eng.target_blocks.num_used == 0 and eng.target_blocks.num_free == num_pages
    if eng.drafter_blocks is not None:
        assert eng.drafter_blocks.num_used == 0
    assert bad > 0


def test_nan_logits_fail_one_request_only(pair):
    target, drafter = pair
    dec = Decoder.from_pretrained(target, drafter, mode="dspark", dtype="float64")
    eng = dec.new_engine(num_pages=64)
    ids = [eng.add_request(p, SamplingParams(max_tokens=8, **GREEDY)) for p in ([1, 2, 3], [4, 5], [6])]
    poisoned = ids[1]

    class PoisonedRound(Round):  # the target's rows of one request turn NaN
        def accept(self, runner, batch, draft, plan, logits, rng):
            for i, stream in enumerate(batch.streams):
                if stream == poisoned + 1:  # requests without a seed draw stream id + 1
                    logits[plan.cu[i]] = float("nan")
            return super().accept(runner, batch, draft, plan, logits, rng)

    eng.round = PoisonedRound()
    results = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                results[o.request_id] = o
    assert results[poisoned].error and results[poisoned].output.finish_reason == "error"
    for rid, p in zip((ids[0], ids[2]), ([1, 2, 3], [6])):
        assert results[rid].error is None and results[rid].output.token_ids == _alone(target, p, 8)


def test_stream_deltas_add_up(pair):
    target, drafter = pair
    dec = Decoder.from_pretrained(target, drafter, mode="dspark", dtype="float64")
    eng = dec.new_engine(num_pages=64)
    deltas = list(eng.stream([7, 8, 9], SamplingParams(max_tokens=15, **GREEDY)))
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    toks = [t for d in deltas for t in d.new_token_ids]
    assert toks == deltas[-1].output.token_ids == _alone(target, [7, 8, 9], 15)
    assert len(deltas) > 1  # tokens arrive round by round, not at the end


def test_bad_engine_arguments(pair):
    dec = Decoder.from_pretrained(pair[0], mode="ar")
    with pytest.raises(ValueError, match="num_pages"):
        dec.new_engine(num_pages=0)
    with pytest.raises(ValueError, match="watermark"):
        dec.new_engine(watermark=1.0)
    with pytest.raises(ValueError, match="not both"):
        dec.new_engine(EngineConfig(num_pages=4), num_pages=8)
    eng = dec.new_engine(num_pages=4)
    with pytest.raises(ValueError):
        eng.add_request([1] * 200, SamplingParams(max_tokens=2))  # can never fit 4 pages
    assert not eng.abort(12345)


def test_decoder_stream(pair):
    dec = Decoder.from_pretrained(pair[0], pair[1], mode="dspark", dtype="float64")
    deltas = list(dec.stream([3, 1, 4], SamplingParams(max_tokens=9, **GREEDY)))
    assert [t for d in deltas for t in d.new_token_ids] == _alone(pair[0], [3, 1, 4], 9)


@pytest.mark.parametrize("drafter_cached", [True, False])
def test_prefix_cache_keeps_outputs_and_acceptance(pair, drafter_cached):
    """Requests sharing a long prefix reuse its target pages; the drafter's context for the
    cached prefix is reused (drafter_cached) or rebuilt from target features (rebuild mode).
    Either way tokens AND acceptance equal a run without any caching: a wrong drafter context
    would keep the tokens (verification is lossless) but change which drafts are accepted."""
    target, drafter = pair
    common = [rng_tok for rng_tok in random.Random(5).choices(range(90), k=27)]
    prompts = [common + [i, i + 1] for i in range(4)]

    def run(caching):
        dec = Decoder.from_pretrained(target, drafter, mode="dspark", dtype="float64", page_size=4)
        eng = dec.new_engine(num_pages=128, enable_prefix_caching=caching)
        if caching and not drafter_cached:
            eng.drafter_blocks.enable_prefix_caching = False
        starts, outs = [], {}
        real = eng.scheduler.schedule

        def schedule():
            out = real()
            starts.extend((c.req.request_id, c.start, c.target_from) for c in out.prefills)
            return out

        eng.scheduler.schedule = schedule
        for p in prompts:  # one after another, so later ones find the first one's pages
            if caching and not drafter_cached:  # nothing in the drafter cache may be reused
                eng.runner.dcache.k_all.normal_()
                eng.runner.dcache.v_all.normal_()
            for o in eng.stream(p, SamplingParams(max_tokens=10, **GREEDY)):
                if o.finished:
                    outs[o.request_id] = o.output
        return outs, starts, eng

    ref, _, _ = run(False)
    got, starts, eng = run(True)
    first = {rid: (s, t) for rid, s, t in reversed(starts)}  # each request's first chunk
    later = [first[rid] for rid in sorted(first)[1:]]
    assert all(t >= 24 for _, t in later), f"no prefix hit: {later}"
    if not drafter_cached:
        assert all(s == 0 for s, _ in later), "rebuild mode must recompute the drafter context"
    for rid in ref:
        assert got[rid].token_ids == ref[rid].token_ids
        assert got[rid].metrics.as_dict() == ref[rid].metrics.as_dict()
    assert eng.target_blocks.num_used == 0


@pytest.mark.parametrize("mode,policy,reads", [("ar", "fixed", 1), ("dflash", "fixed", 1),
                                               ("dspark", "fixed", 1), ("dspark", "async", 1),
                                               ("dspark", "threshold", 2), ("dspark", "sync", 2)])
def test_host_reads_per_round(pair, mode, policy, reads):
    """A round reads the device once (its results); a host-side policy that reads confidences
    (threshold, sync) adds one in every round that drafts (a round where no request may verify
    a draft, the last token of each, drafts nothing); async admits on the device."""
    from dspark_rt.policies.sps import SPSProfile
    sps = SPSProfile.from_pairs({B: 1000.0 / (1.0 + B / 4.0) for B in range(1, 65)})
    dec = Decoder.from_pretrained(pair[0], None if mode == "ar" else pair[1], mode=mode,
                                  policy=policy, **({"sps": sps} if policy in ("sync", "async") else {}))
    rnd, drafted = dec.engine.round, []
    draft = rnd.draft

    def counted(*a):
        d = draft(*a)
        drafted.extend([1] if d is not None else [])
        return d
    rnd.draft = counted
    dec.generate([[1, 2], [3, 4, 5], [6]], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    e = dec.engine
    assert e.num_rounds > 3 and len(drafted) >= (e.num_rounds - 3 if mode != "ar" else 0)
    assert e.round_host_reads == e.num_rounds + (reads - 1) * len(drafted)


def _reads_per_step(dec, logprobs: bool, log_rounds: bool) -> tuple[int, int]:
    """(device reads, engine steps) of 8 requests driven through an Engine step by step."""
    dec.round_log = [] if log_rounds else None
    eng = dec.new_engine(EngineConfig(num_pages=64, max_num_seqs=8))
    for i in range(8):
        eng.add_request([1 + i, 2, 3], SamplingParams(max_tokens=10, logprobs=logprobs, **GREEDY))
    r0, steps = dec.runner.host_reads, 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return dec.runner.host_reads - r0, steps


def test_decoder_reads_go_through_the_counted_door(pair):
    """The Decoder's own reads (logprobs, the round log) are counted with the runner's: each adds
    one read per step whatever the batch, never one per request."""
    dec = Decoder.from_pretrained(pair[0], pair[1], mode="dspark", policy="fixed")
    base, steps = _reads_per_step(dec, False, False)
    with_lp, steps_lp = _reads_per_step(dec, True, False)
    with_log, steps_log = _reads_per_step(dec, False, True)
    assert steps == steps_lp == steps_log
    assert with_lp - base == steps, (base, with_lp, steps)
    assert 0 < with_log - base < steps, (base, with_log, steps)  # decode rounds only


@pytest.mark.gpu
@pytest.mark.parametrize("mode,policy", [("ar", "fixed"), ("dspark", "fixed"), ("dspark", "async"),
                                         ("dspark", "sync")])
def test_cuda_syncs_are_the_counted_reads(pair, mode, policy):
    """On a GPU, PyTorch's sync debug mode sees every synchronising call: after warm-up, a
    decoding step synchronises no more often than the runner counted device reads."""
    import warnings
    from dspark_rt.policies.sps import SPSProfile
    sps = SPSProfile.from_pairs({B: 1000.0 / (1.0 + B / 4.0) for B in range(1, 65)})
    dec = Decoder.from_pretrained(pair[0], None if mode == "ar" else pair[1], mode=mode,
                                  policy=policy, device="cuda", dtype="float32",
                                  **({"sps": sps} if policy in ("sync", "async") else {}))
    params = SamplingParams(max_tokens=12, **GREEDY)
    dec.generate([[1, 2], [3, 4, 5]], params, use_tqdm=False)  # warm-up: graphs, allocator
    r0 = dec.runner.host_reads
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dec.generate([[1, 2], [3, 4, 5], [6]], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    reads = dec.runner.host_reads - r0
    assert reads > 0 and syncs <= reads, (syncs, reads)


def test_generate_and_streams_share_one_engine(pair):
    """Two open streams and a generate call step the same Engine: no one loses tokens, each
    output equals its request run alone, and a stream closed early gives its pages back."""
    dec = Decoder.from_pretrained(pair[0], pair[1], mode="dspark", dtype="float64")
    a = dec.stream([5, 6], SamplingParams(max_tokens=14, **GREEDY))
    b = dec.stream([7], SamplingParams(max_tokens=9, **GREEDY))
    got_a = list(next(a).new_token_ids)
    got_b = [t for d in b for t in d.new_token_ids]  # b runs to the end; a advances meanwhile
    (out,) = dec.generate([[8, 9, 10]], SamplingParams(max_tokens=11, **GREEDY), use_tqdm=False)
    got_a += [t for d in a for t in d.new_token_ids]
    assert got_a == _alone(pair[0], [5, 6], 14)
    assert got_b == _alone(pair[0], [7], 9)
    assert out.token_ids == _alone(pair[0], [8, 9, 10], 11)
    c = dec.stream([1, 2, 3], SamplingParams(max_tokens=40, **GREEDY))
    next(c)
    c.close()  # closing early aborts the request
    eng = dec.engine
    assert not eng.has_unfinished() and eng.target_blocks.num_used == 0
    assert eng.drafter_blocks.num_used == 0


def test_an_older_engine_refuses_to_step(pair):
    dec = Decoder.from_pretrained(pair[0], mode="ar")
    old = dec.new_engine(num_pages=8)
    old.add_request([1, 2], SamplingParams(max_tokens=2))
    dec.new_engine(num_pages=8)  # new caches for the same runner
    with pytest.raises(RuntimeError, match="newer Engine"):
        old.step()


def test_device_metadata_equals_host_metadata(pair):
    """The async path builds the verify batch from lengths on the device; its rows equal the
    host-built ones, and the padding rows past the real total write nowhere (slot -1)."""
    from dspark_rt.batch import SamplingBatch, SeqBatch
    dec = Decoder.from_pretrained(pair[0], pair[1], mode="dspark")
    r = dec.runner
    r.page_size = 4
    rng = random.Random(3)
    for _ in range(20):
        R, gamma = rng.randint(1, 5), r.gamma
        kv, pages = [rng.randint(0, 30) for _ in range(R)], [rng.sample(range(100), 10) for _ in range(R)]
        batch = SeqBatch(kv, kv, pages, pages, [0] * R, [gamma] * R, SamplingBatch.of([SamplingParams()] * R),
                         [0] * R, [0] * R, [0] * R)
        lengths = [rng.randint(0, gamma) for _ in range(R)]
        chains = torch.randint(0, 90, (R, gamma + 1))
        pad = rng.randint(0, 5)
        meta, pos, ids = r.meta_on_device(batch, torch.tensor(lengths), R + sum(lengths) + pad, chains)
        want, want_pos, cu = r.meta(pages, kv, [n + 1 for n in lengths], True)
        n = cu[-1]
        assert meta.cu_q.tolist() == want.cu_q.tolist() and meta.kv_lens.tolist() == want.kv_lens.tolist()
        assert torch.equal(meta.block_tables, want.block_tables)
        assert torch.equal(meta.slot_mapping[:n], want.slot_mapping) and torch.equal(pos[:n], want_pos)
        assert ids[:n].tolist() == [t for i, L in enumerate(lengths) for t in chains[i, : L + 1].tolist()]
        assert meta.slot_mapping[n:].tolist() == [-1] * pad and pos[n:].tolist() == [0] * pad


def test_a_bf16_model_serves_bf16_head_weights(pair, monkeypatch):
    """The Markov op gets the drafter's own bf16 weights and hidden states, and the LM head's
    bf16 U as it is with a float32 z buffer (its 16-bit kernel path, no cast pass: the
    benchmarked path is the served one); every token and logprob is what U widened first gives,
    and greedy output is still plain decoding's."""
    from dspark_rt import ops
    seen, real = [], ops.markov_sample
    widen = [False]

    def spy(logits, hidden, anchor, head, **kw):
        seen.append((logits.dtype, kw["out"].dtype, hidden.dtype, kw["w2"].dtype))
        if widen[0]:  # the old path: a cast pass, then z in place
            z = kw.pop("out")
            z.copy_(logits.float())
            return real(z, hidden, anchor, head, **kw)
        return real(logits, hidden, anchor, head, **kw)

    monkeypatch.setattr(ops, "markov_sample", spy)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=True),
              SamplingParams(max_tokens=10, temperature=0.7, top_p=0.8, seed=4, logprobs=True),
              SamplingParams(max_tokens=10, **GREEDY)]
    runs = []
    for w in (False, True):
        widen[0] = w
        dec = Decoder.from_pretrained(pair[0], pair[1], mode="dspark", dtype="bfloat16")
        runs.append(dec.generate(prompts, params, use_tqdm=False))
    assert seen and set(seen) == {(torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16)}
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert sum(o.metrics.num_accepted_tokens for o in runs[0]) > 0
    ar = Decoder.from_pretrained(pair[0], mode="ar", dtype="bfloat16").generate(prompts[2:], params[2:], use_tqdm=False)
    assert runs[0][2].token_ids == ar[0].token_ids


def test_a_bf16_model_verifies_on_its_own_logits(pair, monkeypatch):
    """A bf16 target's verify logits reach the acceptance as the lm_head writes them (no cast
    pass; the kernel widens on load), and every token, logprob and failure is what the widened
    logits give: sampled, filtered and unfiltered requests, logprobs, one batch."""
    from dspark_rt import ops
    seen, real = [], ops.rejection_sample

    def spy(target_logits, *a, **kw):
        seen.append(target_logits.dtype)
        return real(target_logits, *a, **kw)

    monkeypatch.setattr(ops, "rejection_sample", spy)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=True),
              SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, seed=4, logprobs=True),
              SamplingParams(max_tokens=12, **GREEDY)]
    runs = []
    for widen in (False, True):
        dec = Decoder.from_pretrained(pair[0], pair[1], mode="dspark", dtype="bfloat16")
        assert dec.runner.verify_dtype == torch.bfloat16
        if widen:
            dec.runner.verify_dtype = torch.float32
        seen.clear()
        runs.append(dec.generate(prompts, params, use_tqdm=False))
        assert (torch.bfloat16 in seen) != widen, seen
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert all(len(o.logprobs) == 12 for o in runs[0][:2])
    assert sum(o.metrics.num_accepted_tokens for o in runs[0]) > 0


def test_filtering_16bit_logits_keeps_the_widened_nucleus(pair):
    """Top-k / top-p over bf16 verify logits keep exactly the entries they keep over the same
    logits widened to float32 (dividing by T in bf16 moves the nucleus of ~1% of such rows)."""
    from types import SimpleNamespace
    from dspark_rt.runner.logits_process import filter_rows
    runner = Decoder.from_pretrained(pair[0], mode="ar").runner
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, 50, generator=g) * 3).bfloat16()
    params = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.3, top_k=20),
              SamplingParams(temperature=0.3, top_p=0.9, top_k=30)]
    from dspark_rt.batch import SamplingBatch
    batch = SimpleNamespace(sampling=SamplingBatch.of(params))
    cu = [0, 1000, 2000, 3000]
    got = runner.filter(batch, x.clone(), cu)
    want = runner.filter(batch, x.float(), cu)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)
    naive = torch.cat([filter_rows(x[lo:hi] / p.temperature, p.top_k, p.top_p).isinf()
                       for p, lo, hi in zip(params, cu, cu[1:])])
    assert (naive != want.isinf()).any(), "no row where bf16 division moves the nucleus"
