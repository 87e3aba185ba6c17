"""A drafter that emits NaN or inf never changes the output law (DESIGN §2 step 6): a draft row
whose q is not finite (draft_lse NaN / +-inf, a draft logit NaN / +inf) is a rejection, never a
token; its residual is P itself. Greedy and coupled rows compare tokens only and stay exact.
The law end to end: tests/test_lossless_sampling.py (case *-nan, mutant nan-draft-through)."""
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark_rt
from dspark_rt import Decoder, SamplingParams, ops
from dspark_rt.ops import philox, reference
from dspark_rt.testing import op_cases as oc

_CUDA = torch.cuda.is_available() and "cuda" in ops.available_backends()
BACKENDS = ["reference", pytest.param("cpp", marks=pytest.mark.skipif(
                "cpp" not in ops.available_backends(), reason="C++ extension not built")),
            pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
                not _CUDA, reason="needs a GPU and a CUDA build of _C")])]
CASES = [oc.RejectionCase(6, 4, 37, "full", "sampled"),
         oc.RejectionCase(7, 3, 517, "random", "mixed", "random", coupled="mixed"),
         oc.RejectionCase(5, 7, 129, "full", "sampled", noncontig=True),
         oc.RejectionCase(2, 2, 9001, "full", "sampled")]  # two CUDA vocabulary chunks
# what a bad drafter writes into draft row (r, k): (draft logit entries, lse)
POISONS = {"lse-nan": (None, math.nan), "lse-inf": (None, math.inf), "lse-neginf": (None, -math.inf),
           "z-nan": (math.nan, math.nan), "z-inf-entry": ("inf1", math.inf),
           "z-inf-entry-lse-finite": ("inf1", None)}


def _run(kw, backend):
    """ops.rejection_sample on copies of kw (on the GPU for backend cuda); results on the CPU."""
    dev = "cuda" if backend == "cuda" else "cpu"
    kw = {k: v.clone().to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = ops.rejection_sample(kw.pop("target_logits"), kw.pop("cu_rows"), kw.pop("draft_tokens"),
                               kw.pop("draft_logits"), kw.pop("draft_lse"), backend=backend, **kw)
    return tuple(t.cpu() for t in out)


def _poison(kw, k, poison):
    """kw with draft row k of every request poisoned (contiguous copies of the draft tensors)."""
    z, lse = kw["draft_logits"].contiguous().clone(), kw["draft_lse"].clone()
    zv, lv = POISONS[poison]
    if zv == "inf1":
        z[:, k, 5 % z.shape[2]] = math.inf
    elif zv is not None:
        z[:, k] = zv
    if lv is not None:
        lse[:, k] = lv
    return {**kw, "draft_logits": z, "draft_lse": lse}


def _residual_p(kw, r, k):
    """The token emitted at draft row k of request r when that row is rejected in full:
    argmax(log P_k + gumbel(emit, k + 1)) with P_k = softmax(row / T) in float64."""
    cu, T = kw["cu_rows"], float(kw["temperature"][r])
    row = kw["target_logits"][int(cu[r]) + k].double()
    g = philox.gumbel(kw["seed"][r], kw["stream"][r], kw["round_"][r], philox.PURPOSE_EMIT, k + 1,
                      torch.arange(row.shape[0]))
    return int(reference._first_argmax(torch.log(torch.softmax(row / T, -1)) + g))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_nonfinite_draft_row_is_rejected_in_full(case, poison, backend):
    """Row k poisoned: a sampled (uncoupled) request accepts at most k drafts, and when it reaches
    row k it emits the token of the residual P; greedy and coupled requests are unchanged."""
    reached = 0
    for key in range(4):
        kw = oc.rejection_inputs(case, key=key)
        clean = _run(kw, backend)
        k = key % case.gamma
        bad = _poison(kw, k, poison)
        acc, out, failed = _run(bad, backend)
        assert not failed.any()
        ells = (kw["cu_rows"][1:] - kw["cu_rows"][:-1] - 1).tolist()
        coupled = kw.get("coupled", torch.zeros(case.R, dtype=torch.bool))
        for r in range(case.R):
            if float(kw["temperature"][r]) == 0 or bool(coupled[r]) or ells[r] <= k:
                assert int(acc[r]) == int(clean[0][r]) and torch.equal(out[r], clean[1][r]), (r, key)
                continue
            assert int(acc[r]) <= k, (r, key)
            if int(acc[r]) == k:
                reached += 1
                assert int(out[r, k]) == _residual_p(kw, r, k), (r, key)
                assert torch.equal(out[r, :k], kw["draft_tokens"][r, :k])
    assert reached, "no request reached its poisoned row"


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_backends_agree_on_poisoned_and_masked_drafts(case, backend):
    """Random rows poisoned, others with -inf (masked) entries, which are no failure: the
    kernels give the reference's tokens exactly, and the masked rows still accept."""
    accepted = 0
    for key in range(4):
        kw = oc.rejection_inputs(case, key=key)
        g = torch.Generator().manual_seed(key)
        z, lse = kw["draft_logits"].contiguous().clone(), kw["draft_lse"].clone()
        pick = torch.rand(case.R, case.gamma, generator=g)
        z[pick < 0.2] = math.nan
        lse[(pick >= 0.2) & (pick < 0.3)] = math.inf
        masked = pick >= 0.5
        z[..., 1][masked] = -math.inf  # one masked entry: q = 0 there, the row stays usable
        kw = {**kw, "draft_logits": z, "draft_lse": lse}
        got, want = _run(kw, backend), _run(kw, "reference")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), oc.where(case, key)
        accepted += int(want[0].sum())
    assert accepted


def test_nonfinite_q_rule():
    z = torch.tensor([[0.0, 1.0], [0.0, -math.inf], [math.nan, 0.0], [math.inf, 0.0], [0.0, 1.0]])
    lse = torch.tensor([2.0, 1.0, 1.0, 1.0, -math.inf])
    assert reference.nonfinite_q(z, lse).tolist() == [False, False, True, True, True]
    assert reference.nonfinite_q(z[1], lse[1]) is False


PRETRAINED = Path(dspark_rt.__file__).parent / "pretrained"


@pytest.mark.skipif(not (PRETRAINED / "dspark").is_dir(), reason="no shipped pair")
@pytest.mark.parametrize("poisoned", ["markov_head.markov_w2.weight", "fc.weight"])
def test_overflowing_drafter_keeps_the_output_law(tmp_path, poisoned):
    """The shipped DSpark drafter with NaN weights, T = 1: every round rejects at its first
    draft, the tokens are the target's own samples (before the fix: eos, token 0, two tokens
    in), and the metrics count the rejected rounds."""
    drafter = tmp_path / "dspark"
    shutil.copytree(PRETRAINED / "dspark", drafter)
    tensors = load_file(drafter / "model.safetensors")
    tensors[poisoned] = torch.full_like(tensors[poisoned], math.nan)
    save_file(tensors, drafter / "model.safetensors")
    dec = Decoder.from_pretrained(PRETRAINED / "target", drafter, mode="dspark", policy="fixed")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24) for s in range(4)]
    outs = dec.generate(["def parse(text):"] * 4, params, use_tqdm=False)
    plain = Decoder.from_pretrained(PRETRAINED / "target", mode="ar").generate(
        ["def parse(text):"] * 4, params, use_tqdm=False)
    assert [len(o.token_ids) for o in plain] == [24] * 4  # the prompt does not end soon
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == 24, o
        m = o.metrics
        # every round that verified a draft (the last ones may have no room for one)
        assert m.num_nonfinite_drafts == m.verified_by_position[0] > 0
        assert m.num_accepted_tokens == 0 and m.as_dict()["num_nonfinite_drafts"] > 0
