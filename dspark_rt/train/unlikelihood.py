"""Token-level unlikelihood (Welleck et al., 2019, "Neural text generation with unlikelihood
training"): next to the likelihood of the next token, each position pushes down the probability
of the tokens its context already holds, so greedy decoding of a small model stops copying its
own recent output into a loop.

At the position that reads ids[..t] and predicts ids[t + 1], the negative candidates are the
distinct tokens of ids[..t] other than ids[t + 1]; the term is -sum over them of log(1 - p(c)),
averaged over positions. With weight alpha, the loss is cross-entropy + alpha * this.
"""
import torch

__all__ = ["context_candidates", "unlikelihood_loss"]


def context_candidates(inputs: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """inputs, targets [B, L] (targets[:, t] follows inputs[:, ..t]) -> [B, L, vocab] bool: the
    tokens of inputs[b, ..t] at row (b, t), the target itself excluded."""
    seen = torch.zeros(*inputs.shape, vocab, dtype=torch.int8, device=inputs.device)
    seen.scatter_(2, inputs[..., None], 1)
    seen = seen.cummax(dim=1).values.bool()  # a token seen at t is seen at every later t
    return seen.scatter_(2, targets[..., None], False)


def unlikelihood_loss(logits: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V] (float32) at the positions of inputs [B, L] predicting targets [B, L]:
    the mean over positions of -sum_c log(1 - p(c)), c over context_candidates."""
    V = logits.shape[-1]
    cand = context_candidates(inputs, targets, V)
    p = torch.softmax(logits.float(), dim=-1)
    # log(1 - p) from the complement, clamped where p rounds to 1 (the gradient stays finite)
    terms = -torch.log((1.0 - p).clamp_min(1e-5))
    return (terms * cand).sum(-1).mean()
