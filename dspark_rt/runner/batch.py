"""What the runner reads of the requests it runs: plain per-request lists, built by the engine.

The runner never sees a Request and writes nothing back: it computes and returns (RoundResult,
logits). A SeqBatch holds only ints, lists and SamplingParams, so one could be sent to a worker
per tensor-parallel rank unchanged.
"""
from dataclasses import dataclass

from ..sampling_params import SamplingParams  # a dataclass: no torch


def pages_for(n_tokens: int, page_size: int) -> int:
    """Pages that hold n_tokens positions (the one page count of the runtime)."""
    return -(-n_tokens // page_size)


@dataclass
class SeqBatch:
    """R requests. Positions 0 .. kv_lens[i]-1 of request i are in the target cache and
    0 .. ctx_lens[i]-1 have drafter context; anchors[i] (its last emitted token, -1 before the
    first) sits at position kv_lens[i], not yet cached. caps[i]: tokens it may still emit this
    round (max_tokens and the model context both count). rounds[i]: the Philox round key (a
    coupled request's is the number of tokens it emitted so far, DESIGN §2). ctx_lens[i] <
    kv_lens[i] only while the round defers request i's drafter context (it holds the features)."""
    kv_lens: list[int]
    ctx_lens: list[int]
    target_pages: list[list[int]]
    drafter_pages: list[list[int]]
    anchors: list[int]
    caps: list[int]
    params: list[SamplingParams]
    seeds: list[int]
    streams: list[int]
    rounds: list[int]
    ids: list | None = None  # request ids: what the round keeps across rounds is keyed by them

    def __len__(self) -> int:
        return len(self.kv_lens)

    def select(self, rows: list[int]) -> "SeqBatch":
        """The batch of requests rows (in that order)."""
        return SeqBatch(*(None if getattr(self, f) is None else [getattr(self, f)[i] for i in rows]
                          for f in self.__dataclass_fields__))

    @property
    def filtered(self) -> list[bool]:
        """Whether each request's target rows go through top-k / top-p filtering."""
        return [not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in self.params]
