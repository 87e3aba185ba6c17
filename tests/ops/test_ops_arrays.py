"""Foreign arrays through the ops door (ops/arrays.py), on the CPU: a stand-in array type plays
CuPy's part (a numpy array behind __dlpack__ / __dlpack_device__, this module's from_dlpack as
its library's). Outputs come back in the caller's type, in-place writes land in the caller's
memory, no copy is made, torch tensors mix in (the leading tensor sets the answer's type), and
an argument that cannot be viewed is an error naming it. tests/test_ops_cuda.py runs the same with CuPy on a GPU."""
import numpy as np
import pytest
import torch

from dspark_rt import ops
from dspark_rt.testing import op_cases as oc


class Arr:
    """The stand-in foreign array."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def from_dlpack(x):
    """The stand-in library's from_dlpack (the door finds it on Arr's module path)."""
    return Arr(np.from_dlpack(x))


class Stray(Arr):
    """A DLPack array whose library has no from_dlpack: torch tensors come back."""


Stray.__module__ = "stray_library_not_imported"


def _np(t):
    return t.numpy().copy()


def test_outputs_come_back_in_the_callers_type_as_views():
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    out = np.zeros((3, 4), dtype=np.float32)
    got = ops.linear(Arr(_np(x)), Arr(_np(w)), out=Arr(out))
    assert type(got) is Arr and np.shares_memory(got.a, out)  # the caller's out, no copy
    np.testing.assert_array_equal(out, ops.linear(x, w).numpy())
    got = ops.linear(Arr(_np(x)), Arr(_np(w)))
    assert type(got) is Arr
    np.testing.assert_array_equal(got.a, ops.linear(x, w).numpy())


@pytest.mark.parametrize("case", [oc.MarkovCase(3, 4, 37, "gated", conf="markov", coupled="mixed"),
                                  oc.MarkovCase(2, 3, 517, "vanilla", rank=8, temps="sampled")], ids=str)
def test_markov_sample_all_foreign(case):
    """Every tensor argument foreign: the same tokens and floats as torch's, in the caller's
    type, and z written into the caller's logits (in place, no copy)."""
    kw = oc.markov_inputs(case)
    want_z = kw["logits"].clone()
    want = ops.markov_sample(want_z, kw["hidden"], kw["anchor"], kw["head"],
                             **{k: v for k, v in kw.items() if k not in ("logits", "hidden", "anchor", "head")})
    foreign = {k: Arr(_np(v)) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    logits = foreign.pop("logits")
    got = ops.markov_sample(logits, foreign.pop("hidden"), foreign.pop("anchor"), foreign.pop("head"),
                            **foreign)
    assert all(type(g) is Arr for g in got)
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g.a, t.numpy())
    np.testing.assert_array_equal(logits.a, want_z.numpy())


def test_rejection_sample_mixed_torch_and_foreign():
    """The answer's type follows the leading tensor (target_logits): foreign target logits among
    torch tensors answer in the foreign type (int32, int64 and bool outputs); torch target
    logits with foreign seeds (a keyword) answer in torch's. The results are torch's."""
    kw = oc.rejection_inputs(oc.RejectionCase(5, 4, 129, "random", "mixed", coupled="mixed"))
    args = [kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")]
    want = ops.rejection_sample(*args, **kw)
    got = ops.rejection_sample(Arr(_np(args[0])), *args[1:], **kw)
    assert [type(g) for g in got] == [Arr] * 3
    for g, t in zip(got, want):
        np.testing.assert_array_equal(g.a, t.numpy())
    got = ops.rejection_sample(*args, **{**kw, "seed": Arr(_np(kw["seed"])),
                                         "temperature": Arr(_np(kw["temperature"]))})
    assert all(type(g) is torch.Tensor and torch.equal(g, t) for g, t in zip(got, want))


def test_a_written_argument_is_never_copied():
    """A non-contiguous foreign out would be copied, and the op would write the copy: an error."""
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    out = np.zeros((3, 8), dtype=np.float32)[:, ::2]
    with pytest.raises(ops.OpError, match="linear: out must be contiguous"):
        ops.linear(x, w, out=Arr(out))
    with pytest.raises(ops.OpError, match="linear: out must be contiguous"):
        ops.linear(Arr(_np(x)), w, out=Arr(out))


def test_append_kv_writes_the_callers_caches():
    N, pages, ps, h_kv, hd = 5, 3, 4, 2, 8
    k, v = torch.randn(N, h_kv, hd), torch.randn(N, h_kv, hd)
    kc, vc = np.zeros((pages, ps, h_kv, hd), np.float32), np.zeros((pages, ps, h_kv, hd), np.float32)
    slots = torch.tensor([3, -1, 0, 11, 6])
    assert ops.append_kv(Arr(_np(k)), v, Arr(kc), Arr(vc), Arr(_np(slots))) is None
    want_k, want_v = torch.zeros(pages, ps, h_kv, hd), torch.zeros(pages, ps, h_kv, hd)
    ops.append_kv(k, v, want_k, want_v, slots)
    np.testing.assert_array_equal(kc, want_k.numpy())
    np.testing.assert_array_equal(vc, want_v.numpy())


def test_verify_attention_with_a_plan():
    """The plan made from foreign metadata serves the same foreign metadata (views of one
    memory), and stays the door's own object."""
    kw = oc.attention_inputs(oc.AttentionCase((3, 1), (14, 20), 4, 2, 16, 8))
    want = ops.verify_attention(**kw)
    f = {k: Arr(_np(v)) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    plan = ops.plan_verify_attention(f["cu_q"], f["kv_lens"], f["block_tables"], f["k_cache"], h_q=4)
    assert isinstance(plan, ops.VerifyAttentionPlan)
    got = ops.verify_attention(**f, plan=plan)
    assert type(got) is Arr
    np.testing.assert_array_equal(got.a, want.numpy())


def test_a_library_without_from_dlpack_gets_torch_tensors():
    survival = torch.rand(4, 3)
    got = ops.prefix_topk(Stray(_np(survival)), 5)
    assert isinstance(got, torch.Tensor) and torch.equal(got, ops.prefix_topk(survival, 5))


def test_unsupported_objects_are_errors_naming_the_argument():
    kw = oc.rejection_inputs(oc.RejectionCase(2, 2, 37))
    args = [kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")]
    with pytest.raises(ops.OpError, match=r"rejection_sample: seed must be a torch.Tensor .*got list"):
        ops.rejection_sample(*args, **{**kw, "seed": [1, 2]})
    # DLPack has no string dtype: numpy refuses the export, the door names the argument
    with pytest.raises(ops.OpError, match=r"prefix_topk: survival \(.*Arr\) cannot be viewed"):
        ops.prefix_topk(Arr(np.array([["a", "b"]])), 1)
    with pytest.raises(ops.OpError, match=r"rejection_sample: draft_tokens \(.*Arr\) cannot be viewed"):
        ops.rejection_sample(args[0], args[1], Arr(np.array([["x"] * 2] * 2)), *args[3:], **kw)
