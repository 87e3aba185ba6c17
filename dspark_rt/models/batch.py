"""Per-forward attention metadata, built once per forward and read by every layer (plan/run)."""
from dataclasses import dataclass

import torch

from .. import ops


@dataclass
class AttnMeta:
    """Ragged batch over a paged KV cache.

    cu_q [R+1] int32: request r's new tokens are rows cu_q[r] .. cu_q[r+1]-1 of the flat batch.
    kv_lens [R] int32: keys request r attends to, its new tokens included (their K/V are written
    into the cache at slot_mapping before attention).
    block_tables [R, max_pages] int32: page ids of request r's cache.
    slot_mapping [N] int64: flat slot page * page_size + offset of each new token's K/V.
    causal: chains are causal (target) or bidirectional (drafter block).
    window: > 0 for a sliding layer (ops.verify_attention's window), 0 otherwise.
    """
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    window: int = 0

    def plan(self, k_cache: torch.Tensor, h_q: int) -> "ops.VerifyAttentionPlan":
        """The verify_attention plan of a forward over this batch (ops.plan_verify_attention),
        made once and passed to every layer; k_cache: any layer's cache (they share a shape)."""
        return ops.plan_verify_attention(self.cu_q, self.kv_lens, self.block_tables, k_cache,
                                         h_q=h_q, causal=self.causal, window=self.window)
