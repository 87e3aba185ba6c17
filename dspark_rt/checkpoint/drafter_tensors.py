"""Drafter tensors of any packaging, rewritten into what the runner reads (DESIGN §3).

The runner scores drafts with the *target's* LM head over the target vocabulary and adds the
sequential head's bias (ops.markov_sample). Every rewrite here is exact: it changes how the same
proposal distribution is stored, never the distribution.

* copies of the target's embedding / LM head in the drafter file must equal the target's (the
  runtime uses the target's own; a drafter trained against other ones would silently draft worse);
* reduced draft vocabulary (speculators `draft_vocab_size`, `d2t` offsets: target id = draft id +
  d2t[draft id]): the reference samples over the draft vocabulary from lm_head_draft(h) + bias.
  Its lm_head rows must be the target's rows at the mapped ids (speculators copies them frozen,
  DraftVocabMixin.load_verifier_weights); then the same law is target logits plus a bias that is
  -inf outside the draft vocabulary. The Markov head gains one rank whose embedding is constant 1
  and whose projection column is 0 on draft ids and -inf elsewhere (gated / RNN heads: that
  rank's gate / output is pinned to 1 by a saturating bias); a drafter without a head gets this
  rank-1 head alone;
* `rope_interleave`: rotating pairs (2i, 2i+1) equals rotating (i, i + hd/2) after permuting the
  rows of q_proj / k_proj and q_norm / k_norm identically within each head (q.k is unchanged);
* `output_multiplier` scales the logits: folded into the final norm weight (lm_head is linear);
* a confidence head stored without a bias is a bias of 0.
"""
import torch

from .config import CheckpointError
from .drafter_config import DrafterConfig

__all__ = ["adapt", "interleave_to_halves"]

_SAT = 1e4  # sigmoid(1e4) and tanh(1e4) are exactly 1 in float32 and float64


def _same(a: torch.Tensor, b: torch.Tensor, stored: torch.dtype | None = None) -> bool:
    """Equal once both are rounded to `stored`, the dtype the drafter file keeps its copy in
    (a bf16 copy of an fp32 head is that head), else to the coarser of the two."""
    lo = stored or (a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype)
    return a.shape == b.shape and torch.equal(a.to(lo), b.to(lo))


def _target_head(target) -> torch.Tensor:
    return target.embed_tokens.weight if target.lm_head_weight is None else target.lm_head_weight


def interleave_to_halves(head_dim: int) -> torch.Tensor:
    """Row order that turns pair-interleaved rotary rows into the half-split (neox) order."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _permute_heads(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    perm = interleave_to_halves(head_dim).to(w.device)
    return w.view(-1, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def adapt(dcfg: DrafterConfig, tensors: dict, target, vocab_map=None, src: str = "",
          stored=None) -> tuple:
    """tensors: canonical names as loaded (checkpoint.drafter_specs). vocab_map: d2t [V_draft]
    int64 when the drafter has a reduced vocabulary. stored: name -> the torch dtype the file
    keeps it in (copies are compared at that precision). Returns (dcfg, tensors) as the Drafter
    presents them: target vocabulary, half-split rotary, no copies of target tensors."""
    stored = stored or {}
    t = dict(tensors)
    for name, theirs in (("embed_tokens.weight", target.embed_tokens.weight),
                         ("lm_head.weight", _target_head(target))):
        mine = t.get(name)
        if mine is not None and mine.shape[0] == theirs.shape[0]:
            if not _same(mine, theirs, stored.get(name)):
                raise CheckpointError(f"{src}: tensor '{name}' differs from the target's: the "
                                      "drafter was trained against another embedding / LM head, "
                                      "and the runtime drafts with the target's")
            del t[name]
    if dcfg.rope_interleave:
        hd = dcfg.head_dim
        for name in [n for n in t if n.endswith(("q_proj.weight", "k_proj.weight",
                                                  "q_norm.weight", "k_norm.weight"))]:
            t[name] = _permute_heads(t[name], hd)
    if dcfg.output_multiplier != 1.0 and dcfg.dflash2 is None:  # DFlash2 scales its unary only
        t["norm.weight"] = t["norm.weight"] * dcfg.output_multiplier
    if dcfg.confidence and "confidence_head.proj.bias" not in t:
        t["confidence_head.proj.bias"] = t["confidence_head.proj.weight"].new_zeros(1)
    if dcfg.draft_vocab_size is not None:
        dcfg, t = _expand_vocab(dcfg, t, target, vocab_map, src, stored)
    return dcfg, t


def _expand_vocab(dcfg, t, target, d2t, src, stored):
    import dataclasses
    V, Vd, r = dcfg.vocab_size, dcfg.draft_vocab_size, dcfg.markov_rank
    ids = torch.arange(Vd, device=d2t.device) + d2t.long()  # d2t holds offsets
    if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
        raise CheckpointError(f"{src}: tensor 'd2t' maps the draft vocabulary "
                              f"(draft_vocab_size={Vd}) outside or onto repeated target ids")
    head = _target_head(target)
    lm = t.pop("lm_head.weight", None)
    if lm is not None and not _same(lm, head[ids.to(head.device)], stored.get("lm_head.weight")):
        raise CheckpointError(f"{src}: tensor 'lm_head.weight' (draft vocabulary, "
                              f"draft_vocab_size={Vd}) is not the target's LM head at the d2t ids: "
                              "its proposal cannot be formed from the target's logits")
    like = t["fc.weight"]
    mask = torch.full((V,), float("-inf"), dtype=like.dtype, device=like.device)
    mask[ids.to(like.device)] = 0
    w2 = torch.zeros(V, r + 1, dtype=like.dtype, device=like.device)
    w2[:, r] = mask
    w1 = torch.ones(V, r + 1, dtype=like.dtype, device=like.device)
    if r:
        w2[ids.to(like.device), :r] = t["markov_head.markov_w2.weight"]
        w1[:, :r] = t["markov_head.markov_w1.weight"]
    t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"] = w1, w2
    d = dcfg.hidden_size
    if dcfg.head == "gated":  # gate over [h; e]: the new rank's gate is sigmoid(_SAT) = 1
        g, b = t["markov_head.gate_proj.weight"], t["markov_head.gate_proj.bias"]
        g2 = g.new_zeros(r + 1, d + r + 1)
        g2[:r, :d + r] = g
        t["markov_head.gate_proj.weight"] = g2
        t["markov_head.gate_proj.bias"] = torch.cat([b, b.new_full((1,), _SAT)])
    if dcfg.head == "rnn":  # [gate; cand; out] over [s; e; h]: the new rank outputs tanh(_SAT) = 1
        j, b = t["markov_head.joint_proj.weight"], t["markov_head.joint_proj.bias"]
        j2 = j.new_zeros(3 * (r + 1), 2 * (r + 1) + d)
        b2 = b.new_zeros(3 * (r + 1))
        for part in range(3):
            rows_old, rows_new = slice(part * r, (part + 1) * r), slice(part * (r + 1), part * (r + 1) + r)
            j2[rows_new, :r] = j[rows_old, :r]  # s
            j2[rows_new, r + 1:2 * r + 1] = j[rows_old, r:2 * r]  # e
            j2[rows_new, 2 * r + 2:] = j[rows_old, 2 * r:]  # h
            b2[rows_new] = b[rows_old]
        b2[3 * (r + 1) - 1] = _SAT
        t["markov_head.joint_proj.weight"], t["markov_head.joint_proj.bias"] = j2, b2
    if dcfg.confidence_markov:  # features [h; e]: the constant rank gets weight 0
        w = t["confidence_head.proj.weight"]
        t["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, 1)], 1)
    head_type = dcfg.head if dcfg.head != "none" else "vanilla"
    return dataclasses.replace(dcfg, head=head_type, markov_rank=r + 1), t
