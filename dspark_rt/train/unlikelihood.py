"""Token-level unlikelihood (Welleck et al., 2019, "Neural text generation with unlikelihood
training"): next to the likelihood of the next token, each position pushes down the probability
of the tokens its context already holds, so greedy decoding of a small model stops copying its
own recent output into a loop.

At the position that reads ids[..t] and predicts ids[t + 1], the negative candidates are the
distinct tokens of ids[..t] other than ids[t + 1]; the term is -sum over them of log(1 - p(c)),
averaged over positions. With weight alpha, the loss is cross-entropy + alpha * this.

Sequence level (same paper, section 5.2): the model continues prefixes greedily, and every token
of its continuation that belongs to an n-gram seen earlier in the sequence is pushed down at its
position, -log(1 - p(token)): training on the loops the model itself would write.
"""
import torch

__all__ = ["context_candidates", "unlikelihood_loss", "greedy_continue", "repeat_mask",
           "sequence_unlikelihood_loss"]


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


@torch.no_grad()
def greedy_continue(forward, prefix: torch.Tensor, n: int) -> torch.Tensor:
    """prefix [B, P] -> [B, P + n]: n greedy tokens appended, each from forward(ids) -> logits
    [B, L, V] over the whole sequence so far (a dense forward, no cache)."""
    ids = prefix
    for _ in range(n):
        nxt = forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


def repeat_mask(ids: torch.Tensor, start: int, n: int = 4) -> torch.Tensor:
    """ids [B, L] -> [B, L] bool: positions t >= start whose token belongs to an n-gram that
    already occurred earlier in its row (an n-gram ending at s covers s - n + 1 .. s)."""
    B, L = ids.shape
    mask = torch.zeros(B, L, dtype=torch.bool)
    rows = ids.tolist()
    for b in range(B):
        seen = set()
        for s in range(n - 1, L):
            gram = tuple(rows[b][s - n + 1: s + 1])
            if gram in seen and s >= start:
                mask[b, max(start, s - n + 1): s + 1] = True
            seen.add(gram)
    return mask


def sequence_unlikelihood_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [B, L - 1, V] of ids[:, :-1] predicting ids[:, 1:]; mask [B, L] from repeat_mask:
    -log(1 - p(ids[t])) at the positions predicting the masked tokens, averaged over them (0 when
    nothing repeats)."""
    p = torch.softmax(logits.float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:].to(p.device)
    terms = -torch.log((1.0 - p).clamp_min(1e-5)) * m
    return terms.sum() / max(int(m.sum()), 1)
