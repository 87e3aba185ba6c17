"""DFlash2 drafter: its backbone and its candidate-selector proposal.

Reference: z-lab/dflash dflash/model.py (`DFlash2DraftModel`, `GroupedDynamicCausalConv`,
`CandidateSelector`, `dflash_generate`), also loaded by vLLM (PR 52816), SGLang and llama.cpp.

* Backbone: the DFlash (1+N block) backbone whose every decoder layer wraps both sublayers in a
  grouped *dynamic* causal convolution over the block's slots. For a sublayer input x (after its
  RMSNorm), kernel_projection(x) gives per position t, per tap o < K and per channel group g two
  dynamic weights; `prepare` mixes y_t = sum_o (base[0][o] + dyn0[t, o, g]) * x_{t-o} (zero
  before slot 0) and feeds y to the sublayer; `finish` mixes the sublayer output s the same way
  with base[1] and the *second* dynamic weights computed from x: out_t = sum_o (base[1][o] +
  dyn1[t, o, g]) * s_{t-o}. The context K/V (target features) are not convolved.
* Proposal (CandidateSelector.select): unary U_t = softcap(lm_head(h_t) * output_multiplier) over
  the target vocabulary, candidates C_t = top-k(U_t) (k = selector_top_k); with a = the previous
  token (the anchor for slot 1) the score of candidate b is
  S_t(b) = U_t(b) + <A[a] * (H h_t), B[b]> (A, B: predecessor / successor codebooks, H: hidden
  projection, rank selector_rank). Greedy takes argmax S_t; at T > 0 the draft samples from
  q_t = softmax(S_t / T) over the k candidates (zero elsewhere), and acceptance uses that q_t:
  q(x) = q_t[index of x in C_t] and residual max(0, P - q) scattered on C_t (`_rejection_sample`).

Served by the round as ops.markov_sample's "selector" head: U above is the drafter's `logits`,
w1 / w2 the predecessor / successor codebooks, gate_w the hidden projection, top_k the
selector's k; the op writes z = S on the candidates and -inf elsewhere, so the acceptance's
q = exp(z / T - lse) is exactly q_t above (zero outside C_t) and the residual is max(0, P - q)
over the whole vocabulary. `propose` stays as the reference the tests hold the op to.
"""
import torch
from torch import nn

from ..checkpoint.tensors import dflash2_specs  # noqa: F401  (named here too: its tensors)
from .drafter import Drafter

__all__ = ["DFlash2Drafter", "GroupedDynamicConv", "dflash2_specs"]


def _convolve(x, dyn, base, group_size):
    """x [R, B, d], dyn [R, B, K, groups], base [K, d] -> sum_o (base[o] + dyn[:, :, o]) x_{t-o}."""
    R, B, d = x.shape
    groups = d // group_size
    xs = x.view(R, B, groups, group_size)
    out = torch.zeros_like(xs)
    for o in range(base.shape[0]):
        shifted = xs if o == 0 else torch.cat([xs.new_zeros(R, o, groups, group_size), xs[:, :-o]], 1)
        out = out + (base[o].view(groups, group_size) + dyn[:, :, o, :, None]) * shifted
    return out.view(R, B, d)


class GroupedDynamicConv(nn.Module):
    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def prepare(self, x):
        """x [R, B, d] -> (conv'd x, the dynamic kernel `finish` uses)."""
        R, B, d = x.shape
        dyn = self.kernel_projection(x).view(R, B, 2, self.kernel_size, d // self.group_size)
        return _convolve(x, dyn[:, :, 0], self.base_kernel[0], self.group_size), dyn[:, :, 1]

    def finish(self, s, dyn):
        return _convolve(s, dyn, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)


class DFlash2Drafter(Drafter):
    """A DFlash2DraftModel checkpoint (z-lab packaging): forward_block (backbone with the
    convolutions), logits (the unary) and the selector tensors the round hands to
    ops.markov_sample. models.load.load_drafter picks this class for such a folder."""
    allow_dflash2 = True

    def __init__(self, dcfg):
        super().__init__(dcfg)
        f, d = dcfg.dflash2, dcfg.hidden_size
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(d, f["conv_kernel_size"], f["conv_group_size"])
            layer.mlp_conv = GroupedDynamicConv(d, f["conv_kernel_size"], f["conv_group_size"])
        self.candidate_selector = CandidateSelector(dcfg.vocab_size, d, f["selector_rank"],
                                                    f["selector_top_k"])

    @classmethod
    def from_tensors(cls, dcfg, tensors, target):
        model = super().from_tensors(dcfg, tensors, target)
        sel = model.candidate_selector
        model.w1 = sel.predecessor_codebook.weight.detach()
        model.w2 = sel.successor_codebook.weight.detach()
        model.gate_w = sel.hidden_projection.weight.detach()
        return model

    head = property(lambda self: "selector")
    top_k = property(lambda self: self.candidate_selector.top_k)

    def logits(self, hidden, dtype=None):
        """The capped unary, float32 whatever dtype asks (its scale and cap run on float32)."""
        return self.unary_logits(hidden)

    @torch.no_grad()
    def forward_block(self, input_ids, positions, meta, cache):
        if meta.causal:
            raise ValueError("DFlash2Drafter.forward_block: meta.causal must be False")
        B = self.block_size
        h = self.embed(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        R = h.shape[0] // B
        for i, (layer, (m, plan)) in enumerate(zip(self.layers, self.layer_metas(meta, cache))):
            x, k1 = layer.attention_conv.prepare(layer.input_layernorm(h).view(R, B, -1))
            s = layer.self_attn(x.reshape(R * B, -1), cos, sin, m, cache, i, plan)
            h = h + layer.attention_conv.finish(s.view(R, B, -1), k1).reshape(R * B, -1)
            x, k2 = layer.mlp_conv.prepare(layer.post_attention_layernorm(h).view(R, B, -1))
            h = h + layer.mlp_conv.finish(layer.mlp(x.reshape(R * B, -1)).view(R, B, -1),
                                          k2).reshape(R * B, -1)
        return self.norm(h)

    def unary_logits(self, hidden):
        """softcap(lm_head(h) * output_multiplier) (DFlashDraftModel.compute_logits)."""
        u = self._lm_head(hidden) * self.config.dflash2["output_multiplier"]
        cap = self.config.dflash2["final_logit_softcapping"]
        return torch.tanh(u / cap) * cap if cap else u

    @torch.no_grad()
    def propose(self, hidden, anchor, temperature: float = 0.0, generator=None):
        """hidden [R, n, d] (slots 1 .. B-1 of the blocks), anchor [R] -> tokens [R, n],
        candidates [R, n, k], q [R, n, k] (the proposal over the candidates; None when greedy)."""
        sel = self.candidate_selector
        unary, cand = torch.topk(self.unary_logits(hidden), sel.top_k, dim=-1, sorted=False)
        proj = sel.hidden_projection(hidden)
        prev, tokens, qs = anchor, [], []
        for t in range(hidden.shape[1]):
            a = sel.predecessor_codebook(prev) * proj[:, t]  # [R, rank]
            scores = unary[:, t] + torch.einsum("br,bkr->bk", a, sel.successor_codebook(cand[:, t]))
            if temperature > 0:
                q = torch.softmax(scores.double() / temperature, -1)
                idx = torch.multinomial(q, 1, generator=generator)[:, 0]
                qs.append(q)
            else:
                idx = scores.argmax(-1)
            prev = cand[:, t].gather(-1, idx[:, None])[:, 0]
            tokens.append(prev)
        return torch.stack(tokens, 1), cand, (torch.stack(qs, 1) if qs else None)
