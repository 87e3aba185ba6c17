"""The door allocates kernel outputs with torch.empty wherever the kernel writes every element
(rejection_sample's three outputs, prefix_topk's lengths, markov_sample's conf_logit but on CUDA
without a confidence head). Each case runs twice with those allocations poisoned by two
different values: an element a kernel leaves unwritten keeps its poison and the runs differ."""
import pytest
import torch

from dspark_rt import ops
from dspark_rt.testing import op_cases as oc

# Two poisons per dtype, each different from the other: whatever a kernel writes, an element it
# skips holds a different value in the two runs.
POISONS = ({torch.int64: 987654, torch.int32: 4321, torch.bool: True, torch.float32: 1e30,
            torch.float64: 1e300},
           {torch.int64: -7, torch.int32: -9, torch.bool: False, torch.float32: -3.5,
            torch.float64: -2.5})


class _PoisonedTorch:
    """Stands in for an op module's `torch`: empty() fills what it allocates with a poison."""

    def __init__(self, poison):
        self.poison = poison

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *shape, dtype=None, device=None):
        return torch.empty(*shape, dtype=dtype, device=device).fill_(self.poison[dtype])


def _backends():
    out = [pytest.param("cpp", marks=pytest.mark.skipif("cpp" not in ops.available_backends(),
                                                        reason="no C++ extension"))]
    out.append(pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        "cuda" not in ops.available_backends(), reason="no CUDA build of _C")]))
    return out


def _twice(module, monkeypatch, run):
    """run() under each poison; the outputs of the two runs (tuples of tensors)."""
    outs = []
    for poison in POISONS:
        with monkeypatch.context() as m:
            m.setattr(module, "torch", _PoisonedTorch(poison))
            res = run()
        outs.append(res if isinstance(res, tuple) else (res,))
    return outs


def _same(a, b, where):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", oc.REJECTION_CASES, ids=str)
def test_rejection_sample_writes_every_output(case, backend, monkeypatch):
    dev = "cuda" if backend == "cuda" else "cpu"
    kw = oc.rejection_inputs(case, dev)
    args = [kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")]
    a, b = _twice(ops.rejection, monkeypatch,
                  lambda: ops.rejection_sample(*args, backend=backend, **kw))
    _same(a, b, oc.where(case))


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", oc.PREFIX_TOPK_CASES, ids=str)
def test_prefix_topk_writes_every_length(case, backend, monkeypatch):
    dev = "cuda" if backend == "cuda" else "cpu"
    survival, Ks = oc.prefix_topk_inputs(case, dev)
    for K in Ks:
        a, b = _twice(ops.schedule, monkeypatch, lambda: ops.prefix_topk(survival, K, backend=backend))
        _same(a, b, f"{oc.where(case)} K={K}")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", oc.MARKOV_CASES, ids=str)
def test_markov_sample_writes_every_output(case, backend, monkeypatch):
    if backend == "cuda" and case.head == "rnn":
        pytest.skip("the rnn head has no CUDA kernel")
    dev = "cuda" if backend == "cuda" else "cpu"
    kw = oc.markov_inputs(case, dev)
    logits = kw.pop("logits")
    a, b = _twice(ops.markov, monkeypatch, lambda: ops.markov_sample(
        logits.clone(), kw["hidden"], kw["anchor"], kw["head"], backend=backend,
        **{k: v for k, v in kw.items() if k not in ("hidden", "anchor", "head")}))
    _same(a, b, oc.where(case))
