"""SamplingParams(logprobs=N), vLLM's meaning: per emitted token a {token id: Logprob} dict with
the sampled token (its rank in its row) and the N most likely tokens of the target's raw row.
The rows are the target's verify rows, so the numbers are the target's, not the draft's: equal
to a full forward's, and bit for bit equal to plain decoding's (exact mode, the CPU default)."""
import pytest
import torch

from dspark_rt import Decoder, Logprob, SamplingParams
from dspark_rt.sampling_params import MAX_LOGPROBS
from tests.support.helpers import full_forward_logits
from tests.support.shipped_pair import DRAFTERS, PROMPTS, TARGET


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, "5"])
def test_bad_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="SamplingParams.logprobs"):
        SamplingParams(logprobs=value)


@pytest.mark.parametrize("value,want", [(None, None), (False, None), (True, 0), (0, 0), (5, 5)])
def test_logprobs_values(value, want):
    assert SamplingParams(logprobs=value).num_logprobs == want


@pytest.mark.parametrize("n,filters", [(5, {}), (3, {"top_k": 4}), (0, {"top_k": 2, "top_p": 0.9})])
def test_top_logprobs_are_the_targets_raw_rows(tiny_target, tiny_drafters, n, filters):
    """Against log_softmax of a full forward of the target over prompt + output: the sampled
    token's value and rank, and the top n ids and values, before temperature and top-k / top-p
    (a filtered row would give other values, and -inf outside the filter)."""
    dec = Decoder.from_pretrained(tiny_target, tiny_drafters("vanilla", 4), mode="dspark",
                                  dtype="float64")
    prompt = [9, 8, 7]
    p = SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True, logprobs=n, **filters)
    out = dec.generate([prompt], p, use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.token_ids) == 10
    rows = torch.log_softmax(full_forward_logits(dec.target, prompt + out.token_ids).double(), -1)
    for k, (t, d) in enumerate(zip(out.token_ids, lps)):
        row = rows[len(prompt) - 1 + k]
        top = row.topk(n)
        want = {int(i): (float(v), r) for r, (v, i) in enumerate(zip(top.values, top.indices), 1)}
        want.setdefault(t, (float(row[t]), int((row >= row[t]).sum())))
        assert set(d) == set(want), k
        for tid, lp in d.items():
            assert isinstance(lp, Logprob) and lp.rank == want[tid][1], (k, tid)
            assert lp.logprob == pytest.approx(want[tid][0], abs=1e-9), (k, tid)
            assert lp.decoded_token == dec.tokenizer.decode([tid])
    assert out.logprobs == [d[t].logprob for d, t in zip(lps, out.token_ids)]
    assert out.cumulative_logprob == pytest.approx(float(sum(
        rows[len(prompt) - 1 + k, t] for k, t in enumerate(out.token_ids))), abs=1e-9)


@pytest.fixture(scope="module")
def plain():
    return Decoder.from_pretrained(TARGET, mode="ar")


@pytest.mark.parametrize("drafter", ["vanilla", "none"])
def test_logprobs_equal_plain_decodings_bit_for_bit(plain, drafter):
    """Greedy and seeded coupled sampling emit what plain decoding emits; their logprobs dicts
    (values, ranks, top ids) are the same floats: the verify rows are the target's, row for row.
    Drafts are accepted here (the shipped pair), so rows deep in verify chains are compared."""
    spec = Decoder.from_pretrained(TARGET, DRAFTERS[drafter])
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.8, seed=11, coupled=True, max_tokens=24,
                             ignore_eos=True, logprobs=MAX_LOGPROBS)]
    for p in params:
        want = plain.generate(PROMPTS[:4], p, use_tqdm=False)
        got = spec.generate(PROMPTS[:4], p, use_tqdm=False)
        assert sum(o.metrics.num_accepted_draft_tokens for o in got) > 10
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert g.outputs[0].logprobs == w.outputs[0].logprobs
            assert g.cumulative_logprob == w.cumulative_logprob


def test_logprobs_true_keeps_release_01s_shape(plain):
    out = plain.generate(["x = "], SamplingParams(temperature=0, max_tokens=4, logprobs=True),
                         use_tqdm=False)[0]
    assert all(isinstance(x, float) for x in out.logprobs) and len(out.logprobs) == 4
    assert all(len(d) == 1 for d in out.outputs[0].logprobs)  # the sampled token only


def test_one_device_read_per_round_with_logprobs(plain):
    """The top alternatives travel in the round's one logprobs read, not one read per token."""
    spec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"])
    eng = spec.engine
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = _reads_per_round(spec, p)
    assert _reads_per_round(spec, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                 logprobs=7)) == base + 1
    assert eng is spec.engine


def _reads_per_round(dec, p):
    r0, n0 = dec.runner.host_reads, dec.engine.num_rounds
    dec.generate(PROMPTS[:2], p, use_tqdm=False)
    rounds = dec.engine.num_rounds - n0
    return round((dec.runner.host_reads - r0) / rounds)
