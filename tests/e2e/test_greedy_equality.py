"""Greedy speculative output equals plain autoregressive decoding, token for token.

Models run in float64 so that float rounding cannot flip an argmax between the one-token forward
of plain decoding and the multi-token verify forward (in float32 two logits within a few ulps could
swap order between the two reductions; in float64 that needs a near-tie of ~1e-15)."""
import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from tests.support.helpers import full_forward_logits

PROMPTS = [[5], [3, 17, 42, 8, 9, 11, 2], [60, 61], list(range(10, 31)), [7, 7, 7, 7]]


def _decoder(target, drafter=None, **kw):
    return Decoder.from_pretrained(target, drafter, dtype="float64", **kw)


@pytest.fixture(scope="module")
def ar_outputs(tiny_target):
    dec = _decoder(tiny_target, mode="ar")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    return [o.token_ids for o in dec.generate(PROMPTS, params, use_tqdm=False)]


def test_ar_matches_full_recompute(tiny_target, ar_outputs):
    """The paged, incremental AR path against argmax over a fresh full forward at every step."""
    dec = _decoder(tiny_target, mode="ar")
    tgt = dec.target
    for prompt, got in zip(PROMPTS[:3], ar_outputs[:3]):
        seq = list(prompt)
        for _ in range(len(got)):
            seq.append(int(torch.argmax(full_forward_logits(tgt, seq)[-1])))
        assert seq[len(prompt):] == got


@pytest.mark.parametrize("kind", ["none", "vanilla", "gated", "rnn", "zlab"])
@pytest.mark.parametrize("block_size", [1, 4, 7])
@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_speculative_equals_ar(tiny_target, tiny_drafters, ar_outputs, kind, block_size, policy):
    if kind == "zlab" and block_size == 1:
        pytest.skip("a 1+N block of size 1 has no draft slot")
    if policy == "threshold" and kind == "zlab":
        pytest.skip("z-lab DFlash has no confidence head")
    drafter = tiny_drafters(kind, block_size)
    mode = "dflash" if kind in ("none", "zlab") and policy == "fixed" else "dspark"
    dec = _decoder(tiny_target, drafter, mode=mode, policy=policy, threshold=0.3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = dec.generate(PROMPTS, params, use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, ar_outputs, outs):
        assert out.token_ids == ref, f"prompt {prompt}: {kind} gamma-block {block_size} {policy}"
    rounds = sum(o.metrics.num_rounds for o in outs)
    assert rounds > 0


def test_drafts_are_accepted_somewhere(tiny_target, tiny_drafters):
    """The equality tests above only mean something if drafts get accepted and rejected."""
    dec = _decoder(tiny_target, tiny_drafters("vanilla", 4), mode="dspark")
    outs = dec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    acc = sum(o.metrics.num_accepted_tokens for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert 0 < acc < drafted, (acc, drafted)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,mode", [("vanilla", "dspark"), ("gated", "dspark"), ("rnn", "dspark"),
                                       ("none", "dflash"), ("zlab", "dflash")])
def test_cuda_speculative_equals_ar(tiny_target, tiny_drafters, kind, mode):
    """On the GPU in float32 (the CUDA kernels take no float64): speculative output equals plain
    decoding up to the first position whose top two target logits lie within 1e-3 of each other
    in float64 (a near-tie that float32 rounding of the two forwards may order either way)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ar = Decoder.from_pretrained(tiny_target, mode="ar", dtype="float32", device="cuda")
    spec = Decoder.from_pretrained(tiny_target, tiny_drafters(kind, 4), mode=mode,
                                   dtype="float32", device="cuda")
    ref64 = _decoder(tiny_target, mode="ar").target
    for prompt, a, s in zip(PROMPTS, ar.generate(PROMPTS, params, use_tqdm=False),
                            spec.generate(PROMPTS, params, use_tqdm=False)):
        diff = next((i for i, (x, y) in enumerate(zip(a.token_ids, s.token_ids)) if x != y), None)
        if diff is None:
            continue
        top2 = full_forward_logits(ref64, list(prompt) + a.token_ids[:diff])[-1].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-3, f"prompt {prompt}: differs at {diff} without a near-tie"
