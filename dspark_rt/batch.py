"""What the runner reads of the requests it runs: plain per-request lists, built by the engine
once per step (a plain type at the bottom of the package: no torch, no request objects).

The runner never sees a Request or a SamplingParams and writes nothing back: it computes and
returns (RoundResult, logits). A SeqBatch holds only ints, floats and lists, so it is sent to
the workers of tensor-parallel ranks unchanged.
"""
from dataclasses import dataclass, fields


def pages_for(n_tokens: int, page_size: int) -> int:
    """Pages that hold n_tokens positions (the one page count of the runtime)."""
    return -(-n_tokens // page_size)


def _asks_logprobs(p) -> bool:
    """SamplingParams.logprobs: None / False ask for none; True and every int (0: the sampled
    token only) ask for them."""
    return p.logprobs is not None and p.logprobs is not False


@dataclass
class SamplingBatch:
    """The sampling settings of R requests, one list per field (SamplingParams' meaning):
    temperature 0 is greedy; top_k 0 and top_p 1.0 keep every token; coupled: Philox rounds
    keyed by the tokens emitted (DESIGN §2); speculative False: the request never drafts;
    logprobs: it reads its rows' log-probabilities; structured_outputs: its grammar (or None)."""
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    coupled: list[bool]
    speculative: list[bool]
    logprobs: list[bool]
    structured_outputs: list  # StructuredOutputsParams or None: the request's grammar

    @classmethod
    def of(cls, params) -> "SamplingBatch":
        """From SamplingParams (or anything with those attributes), one per request."""
        return cls(*([getattr(p, f.name) if f.name != "logprobs" else _asks_logprobs(p) for p in params]
                     for f in fields(cls)))

    def select(self, rows: list[int]) -> "SamplingBatch":
        return SamplingBatch(*([getattr(self, f.name)[i] for i in rows] for f in fields(self)))

    def __len__(self) -> int:
        return len(self.temperature)

    @property
    def filtered(self) -> list[bool]:
        """Whether each request's target rows go through top-k / top-p filtering."""
        return [t > 0 and (k > 0 or p < 1.0) for t, k, p in zip(self.temperature, self.top_k, self.top_p)]


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
    sampling: SamplingBatch
    seeds: list[int]
    streams: list[int]
    rounds: list[int]
    ids: list | None = None  # request ids: what the round keeps across rounds is keyed by them

    def __len__(self) -> int:
        return len(self.kv_lens)

    def select(self, rows: list[int]) -> "SeqBatch":
        """The batch of requests rows (in that order)."""
        def pick(v):
            if v is None:
                return None
            return v.select(rows) if isinstance(v, SamplingBatch) else [v[i] for i in rows]
        return SeqBatch(*(pick(getattr(self, f.name)) for f in fields(self)))

    @property
    def filtered(self) -> list[bool]:
        return self.sampling.filtered
