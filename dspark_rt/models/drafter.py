"""The DSpark / DFlash drafter backbone (DESIGN §2 steps 1 and 7, §3).

A stack of Qwen3 decoder layers over a paged cache of its own. The cache holds the *context*
(K/V projected from target features of committed positions, written by context_update) followed
by scratch slots for the block being drafted (written by forward_block, overwritten next round).
Block tokens attend bidirectionally to the context and to each other. The token embedding and LM
head are the target's. The sequential head and the confidence head are tensors the runtime hands
to ops.markov_sample.
"""
import torch
from torch import nn

from ..checkpoint import Checkpoint, drafter_specs, resolve_dtype
from ..config import DrafterConfig
from .kv_cache import PagedKVCache
from .batch import AttnMeta
from .qwen3 import DecoderLayer, Qwen3Model, RMSNorm, Rotary, build

__all__ = ["Drafter"]

# file name -> attribute; the runtime passes these straight to ops.markov_sample
_HEAD_TENSORS = {"markov_head.markov_w1.weight": "w1", "markov_head.markov_w2.weight": "w2",
                 "markov_head.gate_proj.weight": "gate_w", "markov_head.gate_proj.bias": "gate_b",
                 "markov_head.joint_proj.weight": "joint_w", "markov_head.joint_proj.bias": "joint_b",
                 "confidence_head.proj.weight": "conf_w", "confidence_head.proj.bias": "conf_b"}


class Drafter(nn.Module):
    def __init__(self, dcfg: DrafterConfig):
        super().__init__()
        cfg = dcfg.model
        self.config = dcfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(dcfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for attr in _HEAD_TENSORS.values():
            self.register_buffer(attr, None)
        self.rotary = None
        self._embed = self._lm_head = None

    @classmethod
    def from_pretrained(cls, path: str, target: Qwen3Model, dtype=None, device=None) -> "Drafter":
        """Loads a DeepSpec (Qwen3DSparkModel) or z-lab (DFlashDraftModel) directory for `target`;
        the config and every tensor are checked against the target before anything is loaded."""
        dcfg = DrafterConfig.from_json(path)
        dcfg.check_target(target.config)
        ckpt = Checkpoint(path)
        required, optional = drafter_specs(dcfg)
        ckpt.check(required, optional, num_layers=dcfg.num_hidden_layers)
        dtype = target.dtype if dtype is None else resolve_dtype(dtype)
        device = target.device if device is None else torch.device(device)
        return cls.from_tensors(dcfg, ckpt.load(required, dtype, device), target)

    @classmethod
    def from_tensors(cls, dcfg: DrafterConfig, tensors: dict, target: Qwen3Model) -> "Drafter":
        """A drafter over tensors named as in its checkpoint (checkpoint.drafter_specs, required
        ones), all of one dtype on one device; embedding and LM head are the target's."""
        tensors = dict(tensors)
        heads = {_HEAD_TENSORS[n]: tensors.pop(n) for n in list(tensors) if n in _HEAD_TENSORS}
        with torch.device("meta"):
            model = cls(dcfg)
        build(model, tensors)
        for attr, t in heads.items():
            setattr(model, attr, t.reshape(-1) if attr == "conf_w" else t)  # [1, k] -> [k]
        fc = model.fc.weight
        model.rotary = Rotary(dcfg.model, fc.dtype, fc.device)
        model._embed, model._lm_head = target.embed, target.lm_head
        return model

    # -- what the runtime reads --------------------------------------------------------------
    head = property(lambda self: self.config.head)
    layout = property(lambda self: self.config.layout)
    gamma = property(lambda self: self.config.gamma)
    block_size = property(lambda self: self.config.block_size)
    mask_token_id = property(lambda self: self.config.mask_token_id)
    target_layer_ids = property(lambda self: list(self.config.target_layer_ids))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def make_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        c = self.config.model
        return PagedKVCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads,
                            c.head_dim, self.dtype, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Base logits U = the target's lm_head(hidden): float32 (float64 for float64 targets)."""
        return self._lm_head(hidden)

    # -- compute ------------------------------------------------------------------------------
    @torch.no_grad()
    def context_update(self, features, positions, slot_mapping, cache: PagedKVCache):
        """features [n, m * d] (target layers target_layer_ids, concatenated) of committed
        positions [n] -> every drafter layer's context K/V at slot_mapping [n] int64:
        ctx = hidden_norm(fc(features)); K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx)."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rotary(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.write(i, k, v, slot_mapping)

    @torch.no_grad()
    def forward_block(self, input_ids, positions, meta: AttnMeta, cache: PagedKVCache):
        """input_ids, positions [N] int64: each request's block ([x0, m, ..., m]). meta must be
        bidirectional (causal=False), kv_lens = context + block, slot_mapping = the block's
        scratch slots right after the context. Returns hidden [N, d] after the final norm."""
        if meta.causal:
            raise ValueError("Drafter.forward_block: meta.causal must be False (blocks attend "
                             "bidirectionally)")
        h = self.embed(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        plan = meta.plan(cache.k[0], self.layers[0].self_attn.h_q)  # once, for every layer
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, cache, i, plan)
        return self.norm(h)
