"""Paged KV cache storage and a minimal page allocator.

A slot is `page * page_size + offset`; request r's key l lives at page block_tables[r, l //
page_size], offset l % page_size (the layout ops.verify_attention reads).
"""
import torch

from . import ops

__all__ = ["PagedKVCache", "PageAllocator", "KVCacheError"]


class KVCacheError(RuntimeError):
    """Bad use of the cache or the allocator (exhaustion, double free, bad shapes)."""


class PagedKVCache:
    """K and V of every layer: k[layer], v[layer] are [num_pages, page_size, h_kv, head_dim] views
    of one contiguous tensor per kind, so each layer's cache is contiguous."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, h_kv: int, head_dim: int,
                 dtype=torch.float32, device="cpu"):
        if min(num_layers, num_pages, page_size, h_kv, head_dim) < 1:
            raise KVCacheError(f"PagedKVCache: all sizes must be >= 1, got num_layers={num_layers}, "
                               f"num_pages={num_pages}, page_size={page_size}, h_kv={h_kv}, "
                               f"head_dim={head_dim}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.h_kv, self.head_dim, self.dtype = h_kv, head_dim, dtype
        shape = (num_layers, num_pages, page_size, h_kv, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))

    @property
    def device(self) -> torch.device:
        return self.k_all.device

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """k, v [N, h_kv, head_dim] (cast to the cache dtype) go to slots slot_mapping [N] int64."""
        n = slot_mapping.shape[0]
        want = (n, self.h_kv, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise KVCacheError(f"PagedKVCache.write: k and v must be {want}, got {tuple(k.shape)} "
                               f"and {tuple(v.shape)}")
        ops.append_kv(k, v, self.k_all[layer], self.v_all[layer], slot_mapping.to(torch.int64))

    def fill_(self, value: float):
        """Poisons every slot (tests fill with NaN to catch reads of slots nobody wrote)."""
        self.k_all.fill_(value)
        self.v_all.fill_(value)


class PageAllocator:
    """Hands out page ids 0..num_pages-1, deterministically: never-used pages lowest id first,
    freed pages are reused first (LIFO)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise KVCacheError(f"PageAllocator: num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._used = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list:
        if n < 0:
            raise KVCacheError(f"PageAllocator.allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise KVCacheError(f"PageAllocator.allocate: out of pages: {n} requested, "
                               f"{len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages):
        pages = [int(p) for p in pages]
        if len(set(pages)) != len(pages):
            raise KVCacheError(f"PageAllocator.free: page ids repeat in {pages}")
        for p in pages:
            if p not in self._used:
                what = "out of range" if not 0 <= p < self.num_pages else "not allocated (double free?)"
                raise KVCacheError(f"PageAllocator.free: page {p} is {what}")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)
