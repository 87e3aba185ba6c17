"""Top-k / top-p filtering of the target's logits before acceptance.

Filtering the target distribution (and not the draft's) keeps acceptance lossless with respect to
the filtered target: the draft q may be any distribution as long as the sampler uses it exactly.
"""
import torch


def filter_rows(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [n, V] -> the same with entries outside the top-k / top-p nucleus set to -inf.

    top_p is applied to softmax(logits) as given (the caller divides by the temperature first
    when it wants the nucleus of the tempered distribution)."""
    V = logits.shape[-1]
    if top_k > 0 and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.to(torch.float64), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each entry
        drop_sorted = before >= top_p  # the first entry is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
