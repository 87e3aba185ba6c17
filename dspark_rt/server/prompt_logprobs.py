"""The prompt's log-probabilities in the two shapes clients read them.

The engine gives, per prompt token, None (token 0) or {token_id: logprob}: the prompt token
first, then the top M alternatives (M = SamplingParams.prompt_logprobs, the larger of what the
request asked in its two fields). Each field is cut to its own N <= M here: the top N by value
of an entry are the true top N, since the entry holds the true top M.

* completions' `echo` with `logprobs: N` (OpenAI's legacy shape, what lm-eval's
  `local-completions` reads): {tokens, token_logprobs, top_logprobs, text_offset} of the prompt
  tokens, first entry null, each top_logprobs entry the prompt token and the top N by text;
* vLLM's `prompt_logprobs: N` field: [null, {token_id: {logprob, rank, decoded_token}}, ...]
  (rank: 1 + the alternatives more likely; null for a prompt token outside the top M, whose
  rank was not computed).
"""
from dataclasses import dataclass


@dataclass
class Prompt:
    """What a response shows of its prompt: text and ids; echo (completions: the text, and with
    logprobs the prompt tokens' top `top`, come first); field: vLLM's prompt_logprobs N (None:
    not asked); computed: the engine's M; score_only: max_tokens 0, nothing generated shown."""
    text: str
    ids: list[int]
    echo: bool
    top: int
    field: int | None
    computed: int | None
    score_only: bool = False


def cut(entry: dict, token: int, n: int) -> dict:
    """{token: its logprob} followed by the top n of the entry, most likely first."""
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
    return {token: entry[token], **dict(top)}


def legacy(piece, ids, entries, n: int) -> dict:
    """The prompt part of completions' logprobs (echo): piece(token_id) -> its text."""
    pieces = [piece(t) for t in ids]
    offsets, o = [], 0
    for p in pieces:
        offsets.append(o)
        o += len(p)
    lps, tops = [], []
    for t, e in zip(ids, entries):
        lps.append(None if e is None else e[t])
        tops.append(None if e is None else {piece(k): v for k, v in cut(e, t, n).items()})
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def vllm(piece, ids, entries, n: int, computed: int) -> list:
    """vLLM's prompt_logprobs field, cut to n of the computed top alternatives."""
    out = []
    for t, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        in_top = len(e) == computed  # the prompt token is one of the top M
        out.append({str(k): {"logprob": v,
                             "rank": (1 + sum(w > v for w in e.values())
                                      if k != t or in_top else None),
                             "decoded_token": piece(k)}
                    for k, v in cut(e, t, n).items()})
    return out
