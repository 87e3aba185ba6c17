"""append_kv: new tokens' K/V written into their paged-cache slots, in place, behind the door."""
import torch

from . import arrays, door, reference
from .door import DTYPE_CODE, ext, ptr
from ._check import fail, foreign, int_range, tensor


def append_kv(k, v, k_cache, v_cache, slot_mapping, *, backend=None):
    """Writes k, v [N, h_kv, head_dim] into k_cache, v_cache [num_pages, page_size, h_kv,
    head_dim] at slot_mapping [N] int64 (page * page_size + offset; -1 = padding, not written),
    in place; see reference.append_kv. The caches must be contiguous (they are written)."""
    op = "append_kv"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4 or not c.is_contiguous():
            if foreign(c):
                return arrays.call(append_kv, locals())
            fail(op, f"{name} must be a contiguous [num_pages, page_size, h_kv, head_dim] tensor")
    dev, fdt = k_cache.device, k_cache.dtype
    be = door.pick(op, dev, backend, None)
    num_pages, page_size, h_kv, hd = k_cache.shape
    tensor(op, "v_cache", v_cache, dtype=fdt, shape=tuple(k_cache.shape), device=dev)
    slot_mapping = tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=dev)
    N = slot_mapping.shape[0]
    k = tensor(op, "k", k, shape=(N, h_kv, hd), device=dev).to(fdt)
    v = tensor(op, "v", v, shape=(N, h_kv, hd), device=dev).to(fdt)
    int_range(op, "slot_mapping", slot_mapping, -1, num_pages * page_size)
    if be == "reference":
        return reference.append_kv(k, v, k_cache, v_cache, slot_mapping)
    p = ext.AppendKvParams()
    p.N, p.h_kv, p.head_dim, p.page_size, p.num_pages = N, h_kv, hd, page_size, num_pages
    p.dtype = DTYPE_CODE[fdt]
    p.k, p.v, p.k_cache, p.v_cache = ptr(k), ptr(v), ptr(k_cache), ptr(v_cache)
    p.slot_mapping = ptr(slot_mapping)
    door.run("append_kv", p, be, dev)
