"""Which slice of each checkpoint tensor a rank holds, and loading only that slice.

Megatron-style: q / k / v and gate / up projections are column-parallel (rows of the weight,
whole heads), o / down projections row-parallel (columns), embedding and LM head
vocabulary-parallel (rows, padded to ceil(V / N) per rank). With fewer KV heads than ranks, each
KV head is replicated on N / h_kv consecutive ranks, the ones whose query heads read it. Norms,
the drafter's fc and its sequential and confidence heads are whole on every rank.
Loading goes through safetensors' get_slice: no rank reads more than its slices.
"""
import dataclasses
import re

import torch

from ..checkpoint import Checkpoint, resolve_dtype
from ..checkpoint import TargetConfig

__all__ = ["Shard", "load_slices"]

_COLUMN = re.compile(r"(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.weight$")
_ROW = re.compile(r"(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


class Shard:
    """Rank `rank` of `size` over the decoder stack `cfg` (a target's, or a drafter's layers)."""

    def __init__(self, cfg: TargetConfig, rank: int, size: int):
        hq, hkv, inter, V = (cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.intermediate_size, cfg.vocab_size)
        if hq % size or inter % size:
            raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={hq} "
                             f"and intermediate_size={inter} ({cfg.source})")
        if (hkv % size) if hkv >= size else (size % hkv):
            raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={hkv} must "
                             f"divide one another ({cfg.source})")
        self.cfg, self.rank, self.size, hd = cfg, rank, size, cfg.head_dim
        self.h_q = hq // size
        self.h_kv = max(1, hkv // size)
        kv0 = rank * hkv // size if hkv >= size else rank // (size // hkv)
        self.q_rows = (rank * self.h_q * hd, (rank + 1) * self.h_q * hd)
        self.kv_rows = (kv0 * hd, (kv0 + self.h_kv) * hd)
        self.inter = inter // size
        self.mlp_rows = (rank * self.inter, (rank + 1) * self.inter)
        self.vocab_per_rank = -(-V // size)
        self.vocab = (min(V, rank * self.vocab_per_rank), min(V, (rank + 1) * self.vocab_per_rank))

    def local_config(self) -> TargetConfig:
        """The decoder-stack shape this rank builds (its heads, MLP width, vocabulary rows)."""
        return dataclasses.replace(self.cfg, num_attention_heads=self.h_q,
                                   num_key_value_heads=self.h_kv, intermediate_size=self.inter,
                                   vocab_size=self.vocab_per_rank)

    def slice_of(self, name: str):
        """(dim, lo, hi) of tensor `name` this rank holds, or None for the whole tensor."""
        if _VOCAB.search(name):
            return (0,) + self.vocab
        m = _COLUMN.search(name)
        if m:
            kind = m.group(1)
            rows = (self.q_rows if kind.endswith("q_proj") else self.mlp_rows if "mlp" in kind
                    else self.kv_rows)
            return (0,) + rows
        m = _ROW.search(name)
        if m:
            return (1,) + (self.q_rows if "o_proj" in m.group(1) else self.mlp_rows)
        return None

    def load(self, ckpt: Checkpoint, names, dtype, device) -> dict:
        """This rank's slices of the named tensors (vocabulary shards zero-padded to
        vocab_per_rank rows), cast to dtype, on device."""
        out = load_slices(ckpt, {n: self.slice_of(n) for n in names}, dtype, device)
        for n, t in out.items():
            if _VOCAB.search(n) and t.shape[0] < self.vocab_per_rank:
                pad = t.new_zeros((self.vocab_per_rank - t.shape[0],) + tuple(t.shape[1:]))
                out[n] = torch.cat([t, pad])
        return out


def load_slices(ckpt: Checkpoint, slices: dict, dtype, device) -> dict:
    """slices: name -> (dim, lo, hi) or None (whole). Reads only those bytes of each file."""
    return ckpt.load(list(slices), dtype, device, slices)
