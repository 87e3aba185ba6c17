"""Dense, differentiable forwards for training: the target over [B, L] sequences (causal) and the
drafter's block attention over [context ; block] (DESIGN §2 steps 1 and 7).

They run the runtime's own modules (DecoderLayer, RMSNorm, apply_rope from models/qwen3.py) with
plain PyTorch SDPA instead of the paged cache, so a trained state dict is the runtime's state dict.
tests/tools/test_train.py checks both against the paged runtime forwards on the same weights.
"""
import torch
import torch.nn.functional as F

from ..models.qwen3 import apply_rope

__all__ = ["target_forward", "block_mask", "drafter_block_forward"]


def _rope(x, cos, sin):
    """x [B, N, heads, hd]; cos, sin [B * N, hd] or [N, hd] (shared by the batch)."""
    B, N, H, hd = x.shape
    if cos.shape[0] != B * N:
        cos, sin = cos.repeat(B, 1), sin.repeat(B, 1)
    return apply_rope(x.reshape(B * N, H, hd), cos, sin).view(B, N, H, hd)


def _queries(attn, x, cos, sin):
    B, N, _ = x.shape
    q = attn.q_proj(x).view(B, N, attn.h_q, attn.head_dim)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    return _rope(q, cos, sin)


def _keys_values(attn, x, cos, sin):
    """The runtime's project_kv (k_proj, k_norm, rope; v_proj) on x [B, N, d]."""
    B, N, _ = x.shape
    if cos.shape[0] != B * N:
        cos, sin = cos.repeat(B, 1), sin.repeat(B, 1)
    k, v = attn.project_kv(x.reshape(B * N, -1), cos, sin)
    return k.view(B, N, attn.h_kv, attn.head_dim), v.view(B, N, attn.h_kv, attn.head_dim)


def _attend(attn, q, k, v, mask=None, causal=False):
    """q [B, Nq, h_q, hd], k, v [B, Nk, h_kv, hd], mask [B, Nq, Nk] bool (True = may attend)."""
    B, Nq = q.shape[:2]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None], is_causal=causal, enable_gqa=True)
    return attn.o_proj(o.transpose(1, 2).reshape(B, Nq, attn.h_q * attn.head_dim))


def target_forward(model, ids, capture=(), logits=True):
    """model: a Qwen3Model (its modules; the paged cache is not used). ids [B, L] int64 at
    positions 0..L-1. Returns (logits [B, L, V] in float32 or None, features [B, L, m * d] (the
    outputs of layers `capture`, -1 = embedding, concatenated) or None, final hidden [B, L, d]
    after the final norm)."""
    B, L = ids.shape
    h = model.embed_tokens(ids)
    cos, sin = model.rotary(torch.arange(L, device=ids.device), h.dtype)
    captured = {-1: h} if -1 in capture else {}
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        k, v = _keys_values(a, x, cos, sin)
        h = h + _attend(a, _queries(a, x, cos, sin), k, v, causal=True)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in capture:
            captured[i] = h
    feats = torch.cat([captured[l] for l in capture], dim=-1) if capture else None
    hidden = model.norm(h)
    return (model.lm_head(hidden) if logits else None), feats, hidden


def block_mask(anchors, L: int, gamma: int):
    """anchors [B, A] int64 (block a starts at position anchors[b, a]) -> bool [B, A * gamma,
    L + A * gamma]: a block token sees context positions < its anchor and every token of its own
    block (bidirectional), nothing of the other blocks."""
    B, A = anchors.shape
    dev = anchors.device
    p = anchors.repeat_interleave(gamma, dim=1)  # [B, N] anchor of each query
    ctx = torch.arange(L, device=dev)[None, None, :] < p[:, :, None]  # [B, N, L]
    blk = torch.arange(A, device=dev).repeat_interleave(gamma)
    own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)  # [B, N, N]
    return torch.cat([ctx, own], dim=2)


def drafter_block_forward(net, rotary, embed, feats, block_ids, anchors):
    """The drafter over A blocks per sequence at once.

    net: a module with the runtime drafter's parameters (layers, norm, fc, hidden_norm);
    rotary: a models.qwen3.Rotary; embed: the target's token embedding (frozen);
    feats [B, L, m * d] target features of positions 0..L-1; block_ids [B, A, gamma] int64
    ([x0, m, ..., m]); anchors [B, A] int64, block a at positions anchors[b, a] + 0..gamma-1,
    context = positions < anchors[b, a] (anchors >= 1).
    Returns hidden [B, A, gamma, d] after the final norm (h_k predicts position anchor + k)."""
    B, A, gamma = block_ids.shape
    L = feats.shape[1]
    dev = block_ids.device
    ctx = net.hidden_norm(net.fc(feats))  # [B, L, d]
    dt = ctx.dtype
    cos_c, sin_c = rotary(torch.arange(L, device=dev), dt)
    pos = (anchors[:, :, None] + torch.arange(gamma, device=dev)).reshape(-1)  # [B * A * gamma]
    cos_b, sin_b = rotary(pos, dt)
    mask = block_mask(anchors, L, gamma)
    h = embed(block_ids.reshape(B, A * gamma)).to(dt)
    for layer in net.layers:
        a = layer.self_attn
        kc, vc = _keys_values(a, ctx, cos_c, sin_c)
        x = layer.input_layernorm(h)
        kb, vb = _keys_values(a, x, cos_b, sin_b)
        q = _queries(a, x, cos_b, sin_b)
        h = h + _attend(a, q, torch.cat([kc, kb], 1), torch.cat([vc, vb], 1), mask=mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return net.norm(h).view(B, A, gamma, -1)
