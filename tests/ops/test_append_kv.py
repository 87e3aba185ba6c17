"""append_kv: the C++ backend against the reference, padding slots, and bad slots."""
import pytest
import torch

from dspark_rt import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,h_kv,hd,page_size", [(1, 1, 8, 1), (7, 2, 16, 4), (33, 3, 24, 5)])
def test_cpp_matches_reference(dtype, N, h_kv, hd, page_size):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_pages = N // page_size + 3
    k = torch.randn(N, h_kv, hd, generator=g).to(dtype)
    v = torch.randn(N, h_kv, hd, generator=g).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=g)[:N]
    slots[::3] = -1  # padding tokens are not written
    caches = [torch.full((num_pages, page_size, h_kv, hd), float("nan"), dtype=dtype) for _ in range(4)]
    ops.append_kv(k, v, caches[0], caches[1], slots, backend="reference")
    ops.append_kv(k, v, caches[2], caches[3], slots, backend="cpp")
    for want, got in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(want.isnan(), got.isnan())
        assert torch.equal(want.nan_to_num(), got.nan_to_num())  # a copy: bit-exact
    flat = caches[2].view(-1, h_kv, hd)
    ok = slots >= 0
    assert torch.equal(flat[slots[ok]], k[ok])
    assert flat.isnan().any(dim=(1, 2)).sum() == num_pages * page_size - int(ok.sum())


def test_bad_slots_and_shapes_name_the_argument():
    kc = torch.zeros(2, 4, 1, 8)
    vc = torch.zeros(2, 4, 1, 8)
    k = torch.zeros(3, 1, 8)
    with pytest.raises(ops.OpError, match="slot_mapping"):
        ops.append_kv(k, k, kc, vc, torch.tensor([0, 1, 8]))
    with pytest.raises(ops.OpError, match="slot_mapping"):
        ops.append_kv(k, k, kc, vc, torch.tensor([0, 1, -2]))
    with pytest.raises(ops.OpError, match="k must have shape"):
        ops.append_kv(torch.zeros(3, 2, 8), k, kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(ops.OpError, match="v_cache"):
        ops.append_kv(k, k, kc, torch.zeros(2, 4, 1, 4), torch.tensor([0, 1, 2]))
