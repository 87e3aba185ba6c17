"""The DSpark / DFlash drafter backbone (DESIGN §2 steps 1 and 7, §3).

A stack of Qwen3 decoder layers over a paged cache of its own. The cache holds the *context*
(K/V projected from target features of committed positions, written by context_update) followed
by scratch slots for the block being drafted (written by forward_block, overwritten next round).
Block tokens attend bidirectionally to the context and to each other. The token embedding and LM
head are the target's. The sequential head and the confidence head are tensors the runtime hands
to ops.markov_sample.
"""
import dataclasses
import math

import torch
from torch import nn

from ..checkpoint.tensors import (SAFETENSORS_DTYPES, Checkpoint, dflash2_specs, drafter_aliases,
                                  drafter_specs, resolve_dtype)
from ..checkpoint.drafter_config import DrafterConfig
from ..checkpoint.drafter_tensors import adapt
from .kv_cache import PagedKVCache
from .batch import AttnMeta
from .qwen3 import DecoderLayer, Qwen3Model, RMSNorm, Rotary, acc_dtype, build

__all__ = ["Drafter"]

# file name -> attribute; the runtime passes these straight to ops.markov_sample
_HEAD_TENSORS = {"markov_head.markov_w1.weight": "w1", "markov_head.markov_w2.weight": "w2",
                 "markov_head.gate_proj.weight": "gate_w", "markov_head.gate_proj.bias": "gate_b",
                 "markov_head.joint_proj.weight": "joint_w", "markov_head.joint_proj.bias": "joint_b",
                 "confidence_head.proj.weight": "conf_w", "confidence_head.proj.bias": "conf_b"}


class Drafter(nn.Module):
    allow_dflash2 = False  # DFlash2 checkpoints load only as models.dflash2.DFlash2Drafter

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
        """Loads a drafter directory in any supported packaging (dspark_rt/drafter_formats.py)
        for `target`; the config and every tensor are checked against the target before
        anything is loaded, then rewritten exactly into the runner's form (drafter_tensors)."""
        dcfg = DrafterConfig.from_json(path, allow_dflash2=cls.allow_dflash2)
        dcfg.check_target(target.config)
        ckpt = Checkpoint(path)
        required, optional = drafter_specs(dcfg)
        if dcfg.dflash2 is not None:
            required.update(dflash2_specs(dcfg))
        ckpt.rename(drafter_aliases({**required, **optional}))
        ckpt.check(required, optional, num_layers=dcfg.num_hidden_layers)
        dtype = target.dtype if dtype is None else resolve_dtype(dtype)
        device = target.device if device is None else torch.device(device)
        names = list(required) + [n for n in optional if n in ckpt.entries]
        d2t = None
        if dcfg.draft_vocab_size is not None:
            d2t = ckpt.load_index_tensor("d2t", (dcfg.draft_vocab_size,), device)
            if "t2d" in ckpt.entries:
                t2d = ckpt.load_index_tensor("t2d", (dcfg.vocab_size,), device).bool()
                ids = torch.arange(len(d2t), device=device) + d2t
                if int(t2d.sum()) != len(d2t) or not bool(t2d[ids.clamp(0, len(t2d) - 1)].all()):
                    raise dcfg_error(dcfg, "tensors 't2d' and 'd2t' disagree on the draft "
                                     f"vocabulary (draft_vocab_size={dcfg.draft_vocab_size})")
        stored = {n: SAFETENSORS_DTYPES[ckpt.entries[n][2]] for n in ("embed_tokens.weight", "lm_head.weight")
                  if n in ckpt.entries}
        dcfg, tensors = adapt(dcfg, ckpt.load(names, dtype, device), target, d2t, ckpt.index_file,
                              stored)
        return cls.from_tensors(dcfg, tensors, target)

    @classmethod
    def from_tensors(cls, dcfg: DrafterConfig, tensors: dict, target: Qwen3Model) -> "Drafter":
        """A drafter over tensors in canonical names (checkpoint.drafter_specs, required ones,
        after drafter_tensors.adapt), all of one dtype on one device; embedding and LM head are
        the target's."""
        tensors = dict(tensors)
        heads = {_HEAD_TENSORS[n]: tensors.pop(n) for n in list(tensors) if n in _HEAD_TENSORS}
        with torch.device("meta"):
            model = cls(dcfg)
        build(model, tensors)
        for attr, t in heads.items():
            setattr(model, attr, t.reshape(-1) if attr == "conf_w" else t)  # [1, k] -> [k]
        fc = model.fc.weight
        sc = dcfg.model.rope_scaling
        model.rotary = YarnRotary(dcfg.model, fc.dtype, fc.device) \
            if sc is not None and sc["rope_type"] == "yarn" else Rotary(dcfg.model, fc.dtype, fc.device)
        model._embed, model._lm_head = target.embed, target.lm_head
        return model

    # -- what the runtime reads --------------------------------------------------------------
    head = property(lambda self: self.config.head)
    layout = property(lambda self: self.config.layout)
    gamma = property(lambda self: self.config.gamma)
    block_size = property(lambda self: self.config.block_size)
    mask_token_id = property(lambda self: self.config.mask_token_id)
    target_layer_ids = property(lambda self: list(self.config.target_layer_ids))
    sts_temperatures = property(lambda self: self.config.sts_temperatures)  # shipped in config

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
        e = self._embed(ids).to(self.dtype)
        scale = self.config.input_embedding_scale  # z-lab dflash_config.input_embedding_scale
        return e if scale == 1.0 else e * scale

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Base logits U = the target's lm_head(hidden) in dtype: by default float32 (float64 for
        float64 targets); the model's own dtype gives the product as it is (no cast)."""
        return self._lm_head(hidden, dtype)

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
        for i, (layer, (m, plan)) in enumerate(zip(self.layers, self.layer_metas(meta, cache))):
            h = layer(h, cos, sin, m, cache, i, plan)
        return self.norm(h)

    def layer_metas(self, meta: AttnMeta, cache: PagedKVCache) -> list:
        """(meta, plan) per drafter layer, one plan per distinct kind: z-lab sliding layers
        attend within sliding_window and causally inside the block where causal_layers says so
        (dflash/model.py)."""
        n, cfg = len(self.layers), self.config
        causal = cfg.causal_layers or (False,) * n
        windows = [cfg.sliding_window if w else 0 for w in cfg.window_layers or (False,) * n]
        h_q = self.layers[0].self_attn.h_q
        kinds = {}
        for kind in set(zip(causal, windows)):
            m = dataclasses.replace(meta, causal=kind[0] or meta.causal, window=kind[1])
            kinds[kind] = (m, m.plan(cache.k[0], h_q))
        return [kinds[kind] for kind in zip(causal, windows)]


def dcfg_error(dcfg, msg):
    from ..checkpoint.config import CheckpointError
    return CheckpointError(f"{dcfg.source}: {msg}")


class YarnRotary(Rotary):
    """YaRN rotary (drafters whose config carries rope_scaling type "yarn", e.g. SpecForge and
    DeepSpec configs copied from a YaRN target): inverse frequencies blended between
    interpolation and extrapolation over a ramp of dimensions, cos / sin scaled by the attention
    factor. Transcribed from the definition in transformers' modeling_rope_utils.py
    (_compute_yarn_parameters) and the YaRN paper (arXiv 2309.00071); checked against it in
    tests/checkpoint/test_packagings.py."""

    def __init__(self, cfg, dtype: torch.dtype, device):
        sc, hd, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
        factor, old = sc["factor"], sc["original_max_position_embeddings"]

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = sc["attention_factor"]
        if att is None:
            att = mscale(factor, sc["mscale"]) / mscale(factor, sc["mscale_all_dim"]) \
                if sc["mscale"] and sc["mscale_all_dim"] else mscale(factor)

        def corr_dim(rot):  # dimension whose wavelength makes `rot` turns over `old` positions
            return hd * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr_dim(sc["beta_fast"]), corr_dim(sc["beta_slow"])
        if sc["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, hd - 1)
        hi = hi + 0.001 if lo == hi else hi
        adt = acc_dtype(dtype)
        pos_freqs = base ** (torch.arange(0, hd, 2, dtype=adt) / hd)
        ramp = ((torch.arange(hd // 2, dtype=adt) - lo) / (hi - lo)).clamp(0, 1)
        extra = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
        self.inv_freq = ((1 / (factor * pos_freqs)) * (1 - extra) + (1 / pos_freqs) * extra).to(device)
        self.attention_factor = float(att)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), \
            (emb.sin() * self.attention_factor).to(dtype)
