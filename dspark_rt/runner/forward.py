"""The draft forward of a round (DESIGN §2 steps 1-3), one function for the eager path and the
CUDA-graph buckets (runner/graphs.py captures exactly this)."""
import torch

from .. import ops


def draft_forward(target, drafter, head, head_weights, logits_dtype, head_dtype, anchor,
                  positions, meta, cache, rng, live=None, out=None):
    """The block [anchor, mask, .., mask] of each of R requests through the drafter, the hidden
    states of the gamma draft slots through the target's LM head (U [R, gamma, V]), then
    ops.markov_sample (sequential head, confidence head). live [R] bool: False rows (graph
    padding) get zero hidden, so their logits are finite and their tokens in range whatever the
    unowned rows held. out: (tokens, z, lse, conf) buffers to write instead of fresh tensors.
    z is in logits_dtype (float32; float64 models: float64), the hidden states in head_dtype,
    the dtype of the head's weights (a bf16 model: bf16, the kernels' tensor-core path), U in
    either (a bf16 model's LM head output is read as it is).
    Returns (tokens [R, gamma] int64, z [R, gamma, V], lse [R, gamma], conf_logit [R, gamma])."""
    B, gamma, R = drafter.block_size, drafter.gamma, anchor.shape[0]
    ids = torch.full((R, B), drafter.mask_token_id, dtype=torch.int64, device=anchor.device)
    ids[:, 0] = anchor
    hidden = drafter.forward_block(ids.view(-1), positions, meta, cache).view(R, B, -1)
    # anchor_first: slot k drafts x_{k+1}; the 1+N layout keeps slot 0 for the anchor
    h = hidden[:, :gamma] if drafter.layout == "anchor_first" else hidden[:, 1:]
    h = h.contiguous() if live is None else torch.where(live[:, None, None], h, 0)
    U = drafter.logits(h.reshape(R * gamma, -1), head_dtype).view(R, gamma, -1)
    # U in the head's weight dtype (a 16-bit model) is read as it is and widened on load, z
    # written out of place: no cast pass, and no copy into the graph's buffer
    if U.dtype not in (logits_dtype, head_dtype):
        U = U.to(logits_dtype)
    z = out[1] if out is not None else U if U.dtype == logits_dtype else \
        torch.empty(U.shape, dtype=logits_dtype, device=U.device)
    tokens, _, lse, conf = ops.markov_sample(U, h.to(head_dtype), anchor, head, **head_weights,
                                             **rng, out=z)
    if out is None:
        return tokens, z, lse, conf
    for dst, src in zip((out[0], out[2], out[3]), (tokens, lse, conf)):
        dst.copy_(src)
    return out
