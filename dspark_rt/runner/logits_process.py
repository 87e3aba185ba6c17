"""The logits processors of the target's rows: masks (allowed ids, bad words, min_tokens), then
min-p, top-k and top-p of the tempered distribution (vLLM's order).

Processing the target distribution (and not the draft's) keeps acceptance lossless with respect
to the processed target P': the draft q may be any distribution as long as the sampler uses it
exactly, and a draft P' refuses is rejected. Each verify row is processed with its own context:
row k of a chain [x0, x_1 .. x_l] follows the tokens emitted so far and the drafts x_1 .. x_k.
"""
import torch

NEG_INF = float("-inf")


def filter_rows(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits [n, V] -> the same with entries outside the min-p / top-k / top-p sets -inf.

    min_p drops entries less likely than min_p times the row's most likely; top_p is applied to
    softmax(logits) as given (the caller divides by the temperature first when it wants the
    nucleus of the tempered distribution)."""
    V = logits.shape[-1]
    if min_p > 0.0:
        top = logits.max(dim=-1, keepdim=True).values
        probs = torch.exp((logits - top).to(torch.float64))  # p / p_max
        logits = logits.masked_fill(probs < min_p, NEG_INF)
    if top_k > 0 and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.to(torch.float64), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each entry
        drop_sorted = before >= top_p  # the first entry is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


def ban_bad_words(rows: torch.Tensor, words, recent: list[int], drafts: torch.Tensor | None):
    """rows [n, V] of one request, in place: each word's last token -inf in the rows whose
    context ends with the word's other tokens (a one-token word: in every row). Row k's context
    is recent (the emitted tokens, last one the anchor) then drafts[:k] ([n - 1] on the device,
    or None for a single row). No host read: the matches stay on the device."""
    n, dev = rows.shape[0], rows.device
    drafts = drafts if drafts is not None else torch.empty(0, dtype=torch.int64, device=dev)
    for word in words:
        *prefix, last = word
        if not prefix:
            rows[:, last] = NEG_INF
            continue
        L = len(prefix)
        # L sentinels (-1, never a token) so that every row has a window of L tokens before it:
        # window j is ctx[j - L : j], row k reads window len(recent) + k
        ctx = torch.cat([torch.tensor([-1] * L + list(recent), dtype=torch.int64, device=dev),
                         drafts[: n - 1].to(torch.int64)])
        windows = ctx.unfold(0, L, 1)[len(recent): len(recent) + n]  # [n, L]
        hit = (windows == torch.tensor(prefix, dtype=torch.int64, device=dev)).all(dim=1)
        rows[:, last] = rows[:, last].masked_fill(hit, NEG_INF)


def mask_rows(rows: torch.Tensor, allowed, words, recent, drafts, min_tokens: int, emitted: int,
              min_stop: list[int]):
    """The masks of one request's rows [n, V], in place (greedy or sampled): tokens outside
    allowed (None: none), bad words (ban_bad_words), and min_stop in the rows k whose token
    would be output number emitted + k + 1 <= min_tokens."""
    if allowed is not None:
        keep = torch.zeros(rows.shape[-1], dtype=torch.bool)
        keep[allowed] = True
        rows.masked_fill_(~keep.to(rows.device, non_blocking=True), NEG_INF)
    if words:
        ban_bad_words(rows, words, recent, drafts)
    m = min(rows.shape[0], min_tokens - emitted)
    if m > 0 and min_stop:
        rows[:m, torch.tensor(min_stop, dtype=torch.int64, device=rows.device)] = NEG_INF
