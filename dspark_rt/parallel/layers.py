"""The sharded model pair of one rank: the plain Qwen3 / drafter modules over this rank's slices
(shard.py), with the three points where ranks meet:

* row-parallel o_proj and down_proj: each rank's partial product, all-reduced (sum);
* vocabulary-parallel embedding: each rank looks up the ids in its rows (zeros elsewhere),
  all-reduced; exact, since every sum has one non-zero term;
* vocabulary-parallel LM head: each rank's logits [.., V / N], all-gathered into [.., V] on every
  rank, so sampling, the sequential head and the acceptance see the whole vocabulary everywhere.

Attention needs no collective: a rank's query heads read only its KV heads, and its paged caches
hold only those.
"""
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import Checkpoint, drafter_specs, target_specs
from ..checkpoint.tensors import dflash2_specs, drafter_aliases
from ..checkpoint import CheckpointError, DrafterConfig, TargetConfig
from ..models.dflash2 import DFlash2Drafter
from ..models.drafter import Drafter
from ..models.kv_cache import PagedKVCache
from ..models.linear import project
from ..models.qwen3 import Qwen3Model, acc_dtype
from .comm import TPGroup
from .shard import Shard

__all__ = ["RowParallel", "VocabParallelEmbedding", "ShardedQwen3", "load_target", "load_drafter"]


class RowParallel(nn.Module):
    """A linear layer over this rank's input columns; the ranks' outputs summed."""

    def __init__(self, linear: nn.Linear, group: TPGroup):
        super().__init__()
        self.linear, self.group = linear, group

    @property
    def weight(self):
        return self.linear.weight

    def forward(self, x):
        return self.group.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """Rows lo .. hi-1 of the embedding (weight [V / N rounded up, d], zero-padded)."""

    def __init__(self, weight: torch.Tensor, lo: int, hi: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.lo, self.hi, self.group = lo, hi, group

    def forward(self, ids):
        mine = (ids >= self.lo) & (ids < self.hi)
        local = (ids - self.lo).clamp(0, self.weight.shape[0] - 1)
        return self.group.all_reduce(F.embedding(local, self.weight) * mine[..., None])


class ShardedQwen3(Qwen3Model):
    """A Qwen3Model built over a rank's slices; `config` is the whole model's (what the runner and
    engine read), `local` the shape this rank holds."""
    group: TPGroup
    local: TargetConfig

    def make_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        c = self.local  # this rank's KV heads
        return PagedKVCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads,
                            c.head_dim, self.dtype, self.device)

    def lm_head(self, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        w = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        logits = self.group.gather_last(project(hidden.to(w.dtype), w))
        V = self.config.vocab_size
        if logits.shape[-1] != V:  # the last shard's padding rows
            logits = logits[..., :V].contiguous()
        return logits.to(dtype or acc_dtype(w.dtype))


def _row_parallel(layers, group: TPGroup):
    for layer in layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)


def load_target(path: str, dtype, device, group: TPGroup) -> ShardedQwen3:
    """This rank's shard of a Qwen3 / Llama folder (checked whole first, from the headers)."""
    cfg = TargetConfig.from_json(path)
    ckpt = Checkpoint(path)
    required, optional = target_specs(cfg)
    ckpt.check(required, optional, num_layers=cfg.num_hidden_layers)
    shard = Shard(cfg, group.rank, group.size)
    model = ShardedQwen3.from_tensors(shard.local_config(), shard.load(ckpt, required, dtype, device))
    model.local, model.config, model.group = model.config, cfg, group
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, *shard.vocab, group)
    _row_parallel(model.layers, group)
    return model


def load_drafter(path: str, target: ShardedQwen3, group: TPGroup) -> Drafter:
    """This rank's shard of a drafter folder: its backbone at the target's TP, fc and the heads
    whole; embedding and LM head are the (sharded) target's. A DFlash2 drafter keeps its
    convolutions and candidate selector whole too: they act on whole hidden states (the
    sublayers they wrap end in a row-parallel all-reduce)."""
    dcfg = DrafterConfig.from_json(path, allow_dflash2=True)
    dcfg.check_target(target.config)
    rewritten = [f for f, on in (("packaging " + dcfg.format, dcfg.format not in ("deepspec", "zlab")),
                                 ("draft_vocab_size", dcfg.draft_vocab_size is not None),
                                 ("rope_interleave", dcfg.rope_interleave),
                                 ("input_embedding_scale", dcfg.input_embedding_scale != 1.0),
                                 ("output_multiplier", dcfg.output_multiplier != 1.0 and
                                  dcfg.dflash2 is None)) if on]
    if rewritten:  # models.drafter rewrites these on one process; the shards are not rewritten
        raise CheckpointError(f"{path}: tensor parallelism serves DeepSpec and z-lab drafters in "
                              f"their own layout; this one needs a rewrite ({', '.join(rewritten)}): "
                              "serve it with tensor_parallel_size=1")
    ckpt = Checkpoint(path)
    required, optional = drafter_specs(dcfg)
    if dcfg.dflash2 is not None:
        required.update(dflash2_specs(dcfg))
    ckpt.rename(drafter_aliases({**required, **optional}))
    ckpt.check(required, optional, num_layers=dcfg.num_hidden_layers)
    shard = Shard(dcfg.model, group.rank, group.size)
    # the backbone's heads and MLP width are this rank's; the vocabulary stays whole (the heads)
    local = dataclasses.replace(dcfg, model=dataclasses.replace(shard.local_config(),
                                                                vocab_size=dcfg.vocab_size))
    # the optional tensor the runner reads (the rest are copies of the target's, not loaded)
    names = list(required) + [n for n in ("confidence_head.proj.bias",)
                              if n in optional and n in ckpt.entries]
    tensors = shard.load(ckpt, names, target.dtype, target.device)
    if dcfg.confidence and "confidence_head.proj.bias" not in tensors:  # a head without bias
        tensors["confidence_head.proj.bias"] = tensors["confidence_head.proj.weight"].new_zeros(1)
    model = (DFlash2Drafter if dcfg.dflash2 is not None else Drafter).from_tensors(local, tensors, target)
    _row_parallel(model.layers, group)
    return model
