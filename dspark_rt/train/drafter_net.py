"""The trainable drafter: the runtime Drafter's parameters under DeepSpec names, the sequential
(Markov) head and the confidence head, and the DeepSpec folder writer (DESIGN §2 steps 1-3, §3).

State-dict names are the file's tensor names: layers.{i}.*, norm, fc, hidden_norm,
markov_head.markov_w1 (an Embedding [V, r]), markov_head.markov_w2 (a Linear r -> V, weight
[V, r]), markov_head.gate_proj (Linear d + r -> r, gated), markov_head.joint_proj (Linear
2r + d -> 3r, rnn), confidence_head.proj (Linear -> 1).
"""
import json
import math
import os

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint.tensors import resolve_dtype
from ..checkpoint.config import TargetConfig
from ..models.qwen3 import DecoderLayer, RMSNorm

__all__ = ["DrafterNet", "drafter_config", "save_drafter", "default_layer_ids"]


def default_layer_ids(n_target: int) -> list[int]:
    """Every target layer but the final one, up to 5 of them evenly spaced."""
    ids = list(range(n_target - 1))
    if len(ids) > 5:
        ids = sorted({round(i * (n_target - 2) / 4) for i in range(5)})
    return ids or [-1]


def drafter_config(target_cfg: dict, *, layers: int, gamma: int, target_layer_ids, mask_token_id,
                   head: str, rank: int, confidence: bool) -> dict:
    """A DeepSpec Qwen3DSparkModel config.json: the target's config with the drafter's fields."""
    c = {k: v for k, v in target_cfg.items() if k not in ("mlp_bias", "pretraining_tp")}
    rank = rank if head != "none" else 0
    c.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_hidden_layers=layers,
             tie_word_embeddings=False, layer_types=["full_attention"] * layers,
             use_sliding_window=False, sliding_window=None, max_window_layers=layers,
             num_target_layers=target_cfg["num_hidden_layers"], block_size=gamma,
             target_layer_ids=list(target_layer_ids), mask_token_id=mask_token_id,
             markov_rank=rank, enable_confidence_head=confidence)
    if rank:
        c["markov_head_type"] = head
    if confidence:
        c["confidence_head_with_markov"] = rank > 0
    return c


class MarkovHead(nn.Module):
    """The sequential head (DESIGN §2 step 2, ops.reference.markov_sample), e = W1[x_{k-1}]:
    vanilla  bias_k = W2 e
    gated    bias_k = W2 (sigmoid(gate_proj([h_k; e])) * e)
    rnn      a = joint_proj([s_{k-1}; e; h_k]) split (gate, cand, out) in r-sized thirds,
             s_k = sigmoid(gate) * s_{k-1} + (1 - sigmoid(gate)) * tanh(cand), s_0 = 0,
             bias_k = W2 tanh(out)."""

    def __init__(self, V: int, r: int, d: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"unknown sequential head {kind!r}")
        self.kind, self.rank = kind, r
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)
        self.gate_proj = nn.Linear(d + r, r) if kind == "gated" else None
        self.joint_proj = nn.Linear(2 * r + d, 3 * r) if kind == "rnn" else None
        nn.init.normal_(self.markov_w1.weight, std=1.0)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the plain backbone (bias 0)
        for lin in (self.gate_proj, self.joint_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
                nn.init.zeros_(lin.bias)

    def forward(self, prev, h):
        """prev [..., gamma] int64 x_{k-1}; h [..., gamma, d] -> (bias [..., gamma, V],
        e [..., gamma, r]). The rnn head runs its state along the block axis (dim -2 of h),
        teacher-forced: x_{k-1} is the given token, not a sampled one."""
        e = self.markov_w1(prev)
        if self.kind == "gated":
            e_in = torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e
        elif self.kind == "rnn":
            s = e.new_zeros(e[..., 0, :].shape)
            outs = []
            for k in range(e.shape[-2]):
                ga, ca, oa = self.joint_proj(torch.cat([s, e[..., k, :], h[..., k, :]], -1)) \
                    .split(self.rank, dim=-1)
                sg = torch.sigmoid(ga)
                s = sg * s + (1 - sg) * torch.tanh(ca)
                outs.append(torch.tanh(oa))
            e_in = torch.stack(outs, -2)
        else:
            e_in = e
        return self.markov_w2(e_in), e


class ConfidenceHead(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.proj = nn.Linear(k, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        return self.proj(x)[..., 0]


class DrafterNet(nn.Module):
    def __init__(self, cfg: dict):
        """cfg: a drafter config dict (drafter_config)."""
        super().__init__()
        self.cfg = cfg
        tc = TargetConfig.from_dict(cfg, arch="qwen3")
        d, V, L = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers
        r, m = cfg["markov_rank"], len(cfg["target_layer_ids"])
        self.layers = nn.ModuleList(DecoderLayer(tc) for _ in range(L))
        self.norm = RMSNorm(d, tc.rms_norm_eps)
        self.fc = nn.Linear(m * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, tc.rms_norm_eps)
        self.markov_head = MarkovHead(V, r, d, cfg.get("markov_head_type", "vanilla")) if r else None
        self.confidence_head = ConfidenceHead(d + r) if cfg["enable_confidence_head"] else None
        resid = 0.02 / math.sqrt(2 * L)
        for name, p in self.named_parameters(recurse=True):
            if name.startswith(("markov_head", "confidence_head")):
                continue
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=resid if name.endswith(("o_proj.weight", "down_proj.weight"))
                                else 0.02)

    def backbone_parameters(self):
        return [p for n, p in self.named_parameters()
                if not n.startswith(("markov_head", "confidence_head"))]

    def heads(self, U, h, prev):
        """U [..., gamma, V] base logits, h [..., gamma, d], prev [..., gamma] x_{k-1} ->
        (z [..., gamma, V], conf_logit [..., gamma] or None): the sequential head's corrected
        logits and the confidence logit (the rnn head's state runs along the gamma axis)."""
        if self.markov_head is None:
            z, e = U, None
        else:
            bias, e = self.markov_head(prev, h)
            z = U + bias
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head(h if e is None else torch.cat([h, e], -1))
        return z, conf


def save_drafter(net: DrafterNet, out, dtype="bfloat16"):
    """DeepSpec folder: config.json + model.safetensors. The embedding and LM head are the
    target's and are not duplicated into the file (the runtime treats those copies as optional)."""
    os.makedirs(out, exist_ok=True)
    dt = resolve_dtype(dtype)
    tensors = {n: t.detach().to(dt).contiguous() for n, t in net.state_dict().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**net.cfg, "torch_dtype": str(dt).removeprefix("torch.")}, f, indent=2)
