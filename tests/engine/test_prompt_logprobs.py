"""SamplingParams.prompt_logprobs from the prefill forward: every prompt token's log-probability
given its prefix equals a fresh full forward's log_softmax, bit for bit in float64 and float32
(the CPU target forward is row-invariant, DSPARK_EXACT=1), whatever the chunking, batch, prefix
cache or preemption; the emitted tokens are those of a request that did not ask."""
import random

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from tests.support.helpers import full_forward_logits

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_target, tiny_drafters):
    return tiny_target, tiny_drafters("vanilla", 4)


def _want(target, prompt, n):
    """vLLM's shape from one fresh forward: None, then {token: lp, top n...} per prompt token."""
    lp = torch.log_softmax(full_forward_logits(target, prompt).double(), dim=-1)
    out = [None]
    for p in range(1, len(prompt)):
        entry = {prompt[p]: lp[p - 1, prompt[p]].item()}
        vals, ids = lp[p - 1].topk(n)
        for v, t in zip(vals.tolist(), ids.tolist()):
            entry.setdefault(t, v)
        out.append(entry)
    return out


def _check(target, outs, prompts, n):
    for o, p in zip(outs, prompts):
        got, want = o.prompt_logprobs, _want(target, p, n)
        assert len(got) == len(p) and got[0] is None
        for i, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
            assert list(g) == list(w), f"prompt position {i}: tokens {list(g)} != {list(w)}"
            assert g == w, f"prompt position {i}: {g} != {w}"  # exact: same rows, same maths


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("chunk_size", [5, 64])
def test_equals_full_forward(pair, dtype, chunk_size):
    target, drafter = pair
    dec = Decoder.from_pretrained(target, drafter, dtype=dtype, page_size=4)
    eng = dec.new_engine(num_pages=200, max_num_seqs=8, max_num_batched_tokens=64,
                         chunk_size=chunk_size)
    rng = random.Random(7)
    prompts = [[rng.randrange(90) for _ in range(n)] for n in (1, 2, 9, 23, 30)]
    params = [SamplingParams(max_tokens=6, prompt_logprobs=k, **GREEDY) for k in (3, 0, 5, 1, 20)]
    # a request that does not ask shares the batch; its output, and the askers', are unchanged
    plain = [SamplingParams(max_tokens=6, **GREEDY)] * len(prompts)
    outs = eng.run([eng.make_request(p, sp, i) for i, (p, sp) in
                    enumerate(zip(prompts + prompts[3:4], params + plain[:1]))], use_tqdm=False)
    ref = dec.generate(prompts, plain, use_tqdm=False)
    for o, r, sp in zip(outs, ref, params):
        assert o.token_ids == r.token_ids
        _check(dec.runner.target, [o], [o.prompt_token_ids], sp.prompt_logprobs)
    assert outs[-1].prompt_logprobs is None and ref[0].prompt_logprobs is None
    assert [len(d) for d in outs[2].prompt_logprobs[1:]] and \
        all(5 <= len(d) <= 6 for d in outs[2].prompt_logprobs[1:])
    assert all(len(d) == 1 for d in outs[1].prompt_logprobs[1:])


def test_prefix_cache_hit_is_bypassed(pair):
    """A prompt whose prefix sits in the prefix cache is prefilled from position 0 when it asks
    for prompt log-probabilities (a hit would skip the rows it reads); the others still hit."""
    target, drafter = pair
    dec = Decoder.from_pretrained(target, drafter, dtype="float64", page_size=4)
    eng = dec.new_engine(num_pages=200, enable_prefix_caching=True)
    prompt = random.Random(3).choices(range(90), k=27)
    starts, real = [], eng.scheduler.schedule

    def schedule():
        out = real()
        starts.extend((c.req.request_id, c.start, c.target_from) for c in out.prefills)
        return out

    eng.scheduler.schedule = schedule
    first = eng.run([eng.make_request(prompt, SamplingParams(max_tokens=4, **GREEDY))],
                    use_tqdm=False)[0]
    hit = eng.run([eng.make_request(prompt, SamplingParams(max_tokens=4, **GREEDY))],
                  use_tqdm=False)[0]
    asks = eng.run([eng.make_request(prompt, SamplingParams(max_tokens=4, prompt_logprobs=2,
                                                            **GREEDY))], use_tqdm=False)[0]
    chunk = {rid: (s, t) for rid, s, t in reversed(starts)}  # each request's first chunk
    assert chunk[hit.request_id][1] >= 24, "the plain request should hit the prefix cache"
    assert chunk[asks.request_id] == (0, 0)
    assert first.token_ids == hit.token_ids == asks.token_ids
    _check(dec.runner.target, [asks], [prompt], 2)


def test_preempted_mid_prefill(pair):
    """Few pages: requests are preempted and re-prefilled; their prompt log-probabilities are
    still every position's, once."""
    target, drafter = pair
    dec = Decoder.from_pretrained(target, drafter, dtype="float64", page_size=4)
    eng = dec.new_engine(num_pages=24, max_num_seqs=6, max_num_batched_tokens=24, chunk_size=6)
    rng = random.Random(11)
    prompts = [[rng.randrange(90) for _ in range(rng.randint(10, 30))] for _ in range(6)]
    reqs = [eng.make_request(p, SamplingParams(max_tokens=12, prompt_logprobs=2, **GREEDY), i)
            for i, p in enumerate(prompts)]
    outs = eng.run(reqs, use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    ref = dec.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    _check(dec.runner.target, outs, prompts, 2)


def test_bad_values_named():
    for bad in (-1, 21, 1.5, True, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
