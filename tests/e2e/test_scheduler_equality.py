"""Greedy output under the hardware-aware schedulers equals plain autoregressive decoding.

The sync and async schedulers choose each request's verify length from confidences and a
throughput profile; whatever they choose, greedy output must be the target's own tokens. Runs
in float64 (see test_lossless.py for why) on a batch of prompts of mixed lengths, with a
synthetic profile shaped so the schedulers cut chains (checked: some rounds verify fewer drafts
than the cap allows, some verify more than none) and with one measured by profile_runner.
"""
import pytest

from dspark_rt import Decoder, SamplingParams
from dspark_rt.runner.profiling import profile_runner
from tests.support.profiles import synthetic_profile

PROMPTS = [[5], [3, 17, 42, 8, 9, 11, 2], [60, 61], list(range(10, 31)), [7, 7, 7, 7]]
MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
CASES = [("vanilla", 4), ("gated", 7), ("rnn", 4)]


@pytest.fixture(scope="module")
def ar_outputs(tiny_target):
    dec = Decoder.from_pretrained(tiny_target, mode="ar", dtype="float64")
    return [o.token_ids for o in dec.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _run(base: Decoder, policy: str, sps):
    dec = Decoder(base.target, base.drafter, base.tokenizer, mode="dspark", policy=policy, sps=sps)
    dec.round_log = []
    outs = dec.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs], dec.round_log


def _cut_used_accepted(round_log, gamma):
    """(rounds verifying fewer drafts than gamma and the request's cap allowed, rounds verifying
    at least one draft, drafts accepted). The cap is what the runner allows: remaining tokens minus the target's
    own one; emitted counts are rebuilt from the log (1 token at prefill, accepted + 1 a round)."""
    emitted, cut, used, accepted = {}, 0, 0, 0
    for e in round_log:
        for rid, n, a in zip(e["request_ids"], e["lengths"], e["accepted"]):
            cap = MAX_TOKENS - emitted.setdefault(rid, 1) - 1
            cut += n < min(gamma, cap)
            used += n > 0
            accepted += a
            emitted[rid] += a + 1
    return cut, used, accepted


@pytest.mark.parametrize("kind,gamma", CASES)
def test_schedulers_equal_ar(tiny_target, tiny_drafters, ar_outputs, kind, gamma):
    base = Decoder.from_pretrained(tiny_target, tiny_drafters(kind, gamma), mode="dspark",
                                   dtype="float64")
    sps = synthetic_profile(len(PROMPTS) * (gamma + 1))
    for policy in ("sync", "async"):
        got, log = _run(base, policy, sps)
        assert got == ar_outputs, f"{kind} gamma {gamma} {policy}"
        # the equality means something only if the schedulers cut chains, verify drafts and
        # drafts get accepted
        cut, used, accepted = _cut_used_accepted(log, gamma)
        assert cut > 0 and used > 0 and accepted > 0, (kind, gamma, policy, cut, used, accepted)


@pytest.mark.parametrize("kind,gamma", CASES[:2])
def test_schedulers_equal_ar_measured_profile(tiny_target, tiny_drafters, ar_outputs, kind, gamma):
    base = Decoder.from_pretrained(tiny_target, tiny_drafters(kind, gamma), mode="dspark",
                                   dtype="float64")
    max_B = len(PROMPTS) * (gamma + 1)
    sps = profile_runner(base.runner, B_values=[1, 3, len(PROMPTS), max_B // 2, max_B], seconds=0.1,
                         context_len=16, max_batch=len(PROMPTS), progress=False)
    assert sps.max_tokens == max_B and all(v > 0 for v in sps.rounds_per_s)
    for policy in ("sync", "async"):
        got, _ = _run(base, policy, sps)
        assert got == ar_outputs, f"{kind} gamma {gamma} {policy} (measured profile)"
