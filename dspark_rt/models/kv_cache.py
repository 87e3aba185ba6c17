"""Paged KV cache storage (the engine's block managers hand out its pages).

A slot is `page * page_size + offset`; request r's key l lives at page block_tables[r, l //
page_size], offset l % page_size (the layout ops.verify_attention reads).
"""
import torch

from .. import ops

__all__ = ["PagedKVCache", "KVCacheError"]


class KVCacheError(RuntimeError):
    """Bad use of the cache (bad sizes or shapes)."""


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
