"""Prompt log-probabilities (SamplingParams.prompt_logprobs) from the prefill forward's rows.

The row of position p holds the target's logits after tokens 0..p, so its log_softmax at token
p + 1 is that prompt token's log-probability given its prefix: the target's raw distribution,
before temperature and top-k / top-p, as for emitted tokens (vLLM's default). Token 0 has none.
A chunk [start, end) of a prompt of P tokens fills entries start + 1 .. min(end, P - 1); the
last prompt position's row predicts the first emitted token, which is not a prompt token.

The engine asks the runner for every row of the chunks of requests whose needs_prompt_rows is
set (the scheduler prefills those from position 0, never from a prefix-cache hit) and calls
record() once per step: one device read for all of them.
"""
import torch

_SLICE = 256  # rows widened to float64 at a time: a [rows, V] float64 slice, not [chunk, V]


def record(chunks, first_rows, logits: torch.Tensor, to_host):
    """Writes req.prompt_logprobs of each chunk's request (engine.scheduler.PrefillChunk),
    whose rows of logits [M, V] start at first_rows[i], one per position of the chunk. Entry p:
    {prompt token p: its log-probability} followed by the top N alternatives in rank order
    (N = params.prompt_logprobs; the prompt token appears once, first)."""
    rows, targets, spans = [], [], []
    for c, first in zip(chunks, first_rows):
        req, P = c.req, len(c.req.prompt_ids)
        if c.start == 0:  # a first prefill, or a re-prefill after a preemption: start afresh
            req.prompt_logprobs = [None] * P
        elif req.prompt_logprobs is None:
            raise RuntimeError(f"request {req.request_id}: prompt log-probabilities need the "
                               f"prefill from position 0, got a chunk from {c.start}")
        n = max(0, min(c.end, P - 1) - c.start)
        rows += range(first, first + n)
        targets += req.prompt_ids[c.start + 1 : c.start + 1 + n]
        spans.append((req, c.start + 1, n))
    if not rows:
        return
    top = min(max(req.params.prompt_logprobs for req, _, _ in spans), logits.shape[1])
    dev = logits.device
    rows_d = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    targets_d = torch.tensor(targets, dtype=torch.int64).to(dev, non_blocking=True)
    cols = []
    for lo in range(0, len(rows), _SLICE):
        lp = torch.log_softmax(logits[rows_d[lo : lo + _SLICE]].double(), dim=-1)
        picked = lp.gather(1, targets_d[lo : lo + _SLICE, None])
        if top:  # ids are exact in float64 (V < 2**53): one copy for values and ids
            vals, ids = lp.topk(top, dim=-1)
            picked = torch.cat([picked, vals, ids.double()], 1)
        cols.append(picked)
    host = to_host(torch.cat(cols)).tolist()
    o = 0
    for req, p0, n in spans:
        N = req.params.prompt_logprobs
        for j in range(n):
            row = host[o + j]
            entry = {req.prompt_ids[p0 + j]: row[0]}
            for v, t in zip(row[1 : 1 + N], row[1 + top : 1 + top + N]):
                entry.setdefault(int(t), v)
            req.prompt_logprobs[p0 + j] = entry
        o += n
