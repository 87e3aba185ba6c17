"""The Qwen3 / Llama target in plain PyTorch over the paged KV cache (DESIGN §2 step 5, §3).

Numerics follow transformers: RMSNorm normalises in float32 and scales in the model dtype, rotary
tables are formed in float32 and cast, projections run in the model dtype (accumulated in
float32; under ops.exact_mode through the row-invariant ops.linear), the attention softmax runs
inside ops.verify_attention. A float64 model computes everything in float64 (tests).
The building blocks here (RMSNorm, Rotary, DecoderLayer) are shared with the drafter.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..checkpoint.tensors import Checkpoint, resolve_dtype, target_specs
from ..checkpoint.config import TargetConfig
from .kv_cache import PagedKVCache
from .batch import AttnMeta
from .linear import Linear, project

__all__ = ["Qwen3Model", "RMSNorm", "Rotary", "DecoderLayer", "apply_rope", "rope_inv_freq",
           "pick_dtype", "acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 models stay in float64, everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pick_dtype(cfg: TargetConfig, dtype, device) -> torch.dtype:
    """An explicit dtype wins; otherwise float32 on CPU and the checkpoint's half dtype on GPU."""
    if dtype is not None:
        return resolve_dtype(dtype)
    if torch.device(device).type == "cpu":
        return torch.float32
    try:
        return resolve_dtype(cfg.torch_dtype)
    except ValueError:
        return torch.bfloat16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32 or x.dtype == torch.float64:  # one fused op, same formula
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.to(acc_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: TargetConfig, dtype=torch.float32) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with "linear" or "llama3" scaling applied."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=dtype) / hd))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    factor = sc["factor"]
    if sc["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended
    lo, hi = sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, blended, scaled)


class Rotary:
    """cos / sin tables [N, head_dim] for arbitrary positions (neox layout: halves rotate)."""

    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device):
        self.inv_freq = rope_inv_freq(cfg, acc_dtype(dtype)).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [N, heads, head_dim]; cos, sin [N, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        d, self.h_q, self.h_kv, self.head_dim = (cfg.hidden_size, cfg.num_attention_heads,
                                                 cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = Linear(d, self.h_q * self.head_dim)
        self.k_proj = Linear(d, self.h_kv * self.head_dim)
        self.v_proj = Linear(d, self.h_kv * self.head_dim)
        self.o_proj = Linear(self.h_q * self.head_dim, d)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project_kv(self, x, cos, sin):
        """x [N, d] -> k (normed, rotated), v [N, h_kv, head_dim]."""
        k = self.k_proj(x).view(-1, self.h_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), self.v_proj(x).view(-1, self.h_kv, self.head_dim)

    def forward(self, x, cos, sin, meta: AttnMeta, cache: PagedKVCache, layer: int, plan=None):
        """plan: meta.plan(...) of this forward, shared by every layer (None: the op plans)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.h_q, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        cache.write(layer, k, v, meta.slot_mapping)  # the op reads the new keys from the cache
        o = ops.verify_attention(q, meta.cu_q, cache.k[layer], cache.v[layer], meta.block_tables,
                                 meta.kv_lens, causal=meta.causal, window=meta.window,
                                 scale=self.head_dim ** -0.5, plan=plan)
        return self.o_proj(o.reshape(n, self.h_q * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, inter)
        self.up_proj = Linear(d, inter)
        self.down_proj = Linear(inter, d)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, meta, cache, layer: int, plan=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, cache, layer, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


def build(module: nn.Module, state: dict) -> nn.Module:
    """Puts loaded tensors into a module constructed on the meta device (no random init)."""
    module.load_state_dict(state, strict=True, assign=True)
    return module.requires_grad_(False).eval()


class Qwen3Model(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head_weight = None if cfg.tie_word_embeddings else \
            nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = None

    @classmethod
    def from_pretrained(cls, path: str, dtype=None, device="cpu") -> "Qwen3Model":
        """Loads a transformers Qwen3 / Llama directory; everything is checked before loading."""
        cfg = TargetConfig.from_json(path)
        ckpt = Checkpoint(path)
        required, optional = target_specs(cfg)
        ckpt.check(required, optional, num_layers=cfg.num_hidden_layers)
        dtype = pick_dtype(cfg, dtype, device)
        return cls.from_tensors(cfg, ckpt.load(required, dtype, device))

    @classmethod
    def from_tensors(cls, cfg: TargetConfig, tensors: dict) -> "Qwen3Model":
        """A model over tensors named as in a transformers checkpoint (checkpoint.target_specs),
        all of one dtype on one device."""
        state = {("lm_head_weight" if n == "lm_head.weight" else n.removeprefix("model.")): t
                 for n, t in tensors.items()}
        with torch.device("meta"):
            model = cls(cfg)
        build(model, state)
        emb = model.embed_tokens.weight
        model.rotary = Rotary(cfg, emb.dtype, emb.device)
        return model

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def make_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads,
                            c.head_dim, self.dtype, self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def lm_head(self, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """hidden [..., d] (after the final norm) -> logits [..., V] in dtype, by default float32
        (float64 models: float64). The product runs in the model dtype, as in transformers, so
        dtype = the model's own is the product as it is (no cast)."""
        w = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        return project(hidden.to(w.dtype), w).to(dtype or acc_dtype(w.dtype))

    @torch.no_grad()
    def forward(self, input_ids, positions, meta: AttnMeta, cache: PagedKVCache,
                capture_layers=None, logits_rows=None, logits_dtype=None):
        """input_ids, positions [N] int64 (flat ragged batch); K/V of the new tokens go to the
        cache at meta.slot_mapping. Returns logits [len(logits_rows) or N, V] in logits_dtype
        (see lm_head) and features [N, m * d] in the model dtype: the outputs of decoder layers
        capture_layers (-1: the embedding output), concatenated in the given order; None without
        capture_layers.
        """
        capture = list(capture_layers or [])
        L = len(self.layers)
        bad = [l for l in capture if not -1 <= l < L]
        if bad:
            raise ValueError(f"capture_layers {bad} out of range [-1, {L})")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        captured = {-1: h} if -1 in capture else {}
        plan = meta.plan(cache.k[0], self.layers[0].self_attn.h_q)  # once, for every layer
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, cache, i, plan)
            if i in capture:
                captured[i] = h
        features = torch.cat([captured[l] for l in capture], dim=-1) if capture else None
        if logits_rows is not None:
            h = h[logits_rows]
        return self.lm_head(self.norm(h), logits_dtype), features
