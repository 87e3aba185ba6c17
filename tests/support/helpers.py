"""Test helpers that do not hide what they compute."""
import torch

from dspark_rt.models.kv_cache import PagedKVCache
from dspark_rt.models.batch import AttnMeta


def full_forward_logits(target, seq) -> torch.Tensor:
    """Target logits [len(seq), V] from one fresh causal forward over the whole sequence
    (a new cache, one page per token: nothing incremental is reused)."""
    cfg = target.config
    n = len(seq)
    cache = PagedKVCache(cfg.num_hidden_layers, n, 1, cfg.num_key_value_heads, cfg.head_dim,
                         target.dtype, target.device)
    meta = AttnMeta(cu_q=torch.tensor([0, n], dtype=torch.int32),
                    kv_lens=torch.tensor([n], dtype=torch.int32),
                    block_tables=torch.arange(n, dtype=torch.int32)[None],
                    slot_mapping=torch.arange(n, dtype=torch.int64), causal=True)
    logits, _ = target.forward(torch.tensor(seq, dtype=torch.int64), torch.arange(n), meta, cache)
    return logits


def batched_full_logits(target, seqs: torch.Tensor) -> torch.Tensor:
    """Target logits [S, L, V] of S equal-length sequences seqs [S, L], each in one fresh causal
    forward over the whole sequence (one page per sequence, nothing incremental reused)."""
    cfg = target.config
    S, L = seqs.shape
    cache = PagedKVCache(cfg.num_hidden_layers, S, L, cfg.num_key_value_heads, cfg.head_dim,
                         target.dtype, target.device)
    meta = AttnMeta(cu_q=torch.arange(0, S * L + 1, L, dtype=torch.int32),
                    kv_lens=torch.full((S,), L, dtype=torch.int32),
                    block_tables=torch.arange(S, dtype=torch.int32)[:, None],
                    slot_mapping=torch.arange(S * L, dtype=torch.int64), causal=True)
    logits, _ = target.forward(seqs.reshape(-1), torch.arange(L).repeat(S), meta, cache)
    return logits.view(S, L, -1)
