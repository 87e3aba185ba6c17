"""The logits-processor cases of the lossless harness (tests/support/lossless_harness.py): per
processor, the SamplingParams keywords a request sends and the exact law's side of it, the
same processor applied to the enumerated rows of the 8-token target.

Row k of the enumeration (k = 0..4, predicting y_{k+1}) has emitted y_1 .. y_k before it: that
is its context for bad words and its count for min_tokens, as for verify row k of a chain.
"""
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Proc:
    params: dict                      # SamplingParams keywords
    bad_words: tuple = ()             # token id sequences (the tiny target has no tokenizer)
    min_p: float = 0.0

    def mask(self, logits: torch.Tensor, suffixes: torch.Tensor) -> torch.Tensor:
        """logits [S, 5, V] of the enumerated sequences (suffixes [S, 4]: y_1 .. y_4) ->
        the same with the masks of allowed_token_ids, bad_words and min_tokens."""
        logits = logits.clone()
        V = logits.shape[-1]
        allowed = self.params.get("allowed_token_ids")
        if allowed is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[list(allowed)] = True
            logits[..., ~keep] = NEG_INF
        for *prefix, last in self.bad_words:
            L = len(prefix)
            for k in range(logits.shape[1]):
                if k < L:
                    continue
                hit = (suffixes[:, k - L:k] == torch.tensor(prefix)).all(1) if L else \
                    torch.ones(len(suffixes), dtype=torch.bool)
                logits[hit, k, last] = NEG_INF
        n = self.params.get("min_tokens", 0)
        for t in self.params.get("stop_token_ids", []):
            logits[:, :n, t] = NEG_INF
        return logits


PROCS = {
    "": Proc({}),
    "min_p": Proc({"min_p": 0.3}, min_p=0.3),
    "allowed": Proc({"allowed_token_ids": [0, 1, 2, 3, 5, 7]}),
    # 5 is the target's likeliest token and its drafters' likeliest draft, 3 5 and 5 5 its
    # likeliest pairs: most bans fall on a row whose context ends in a draft
    "bad_words": Proc({}, bad_words=((3, 5), (5, 5), (6,))),
    # stop token 5 masked for all five tokens (a stop would end the request)
    "min_tokens": Proc({"min_tokens": 5, "stop_token_ids": [5]}),
}
