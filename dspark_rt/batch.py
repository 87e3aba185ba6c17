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
    temperature 0 is greedy; top_k 0, top_p 1.0 and min_p 0 keep every token; coupled: Philox
    rounds keyed by the tokens emitted (DESIGN §2); speculative False: the request never drafts;
    logprobs: it reads its rows' log-probabilities. The masks of the target's rows: allowed
    (allowed_token_ids, None: all), bad_words (token id sequences), min_tokens with the ids it
    masks (min_stop: eos unless ignored, and stop_token_ids); emitted: tokens out so far;
    recent: the last of them (as many as the longest bad word's context needs);
    structured_outputs: the request's grammar (or None)."""
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    coupled: list[bool]
    speculative: list[bool]
    logprobs: list[bool]
    min_p: list[float]
    allowed: list[list[int] | None]
    bad_words: list[list[list[int]]]
    min_tokens: list[int]
    min_stop: list[list[int]]
    emitted: list[int]
    recent: list[list[int]]
    structured_outputs: list  # StructuredOutputsParams or None: the request's grammar

    @classmethod
    def of(cls, params, outputs=None, eos_token_ids=()) -> "SamplingBatch":
        """From SamplingParams (or anything with those attributes), one per request; outputs:
        the tokens each has emitted (None: none yet); eos_token_ids: the target's."""
        params = list(params)
        outputs = outputs if outputs is not None else [[] for _ in params]
        words = [p.bad_words_token_ids for p in params]
        need = [max((len(w) - 1 for w in ws), default=0) for ws in words]
        recent = [list(out[max(0, len(out) - n):]) if n else [] for n, out in zip(need, outputs)]
        return cls([p.temperature for p in params], [p.top_k for p in params],
                   [p.top_p for p in params], [p.coupled for p in params],
                   [p.speculative for p in params], [_asks_logprobs(p) for p in params],
                   [p.min_p for p in params], [p.allowed_token_ids for p in params], words,
                   [p.min_tokens for p in params],
                   [list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
                    for p in params],
                   [len(out) for out in outputs], recent,
                   [getattr(p, "structured_outputs", None) for p in params])

    def select(self, rows: list[int]) -> "SamplingBatch":
        return SamplingBatch(*([getattr(self, f.name)[i] for i in rows] for f in fields(self)))

    def __len__(self) -> int:
        return len(self.temperature)

    @property
    def masked(self) -> list[bool]:
        """Whether each request's target rows get a mask (allowed ids, bad words, min_tokens),
        greedy or not."""
        return [a is not None or bool(w) or m > e for a, w, m, e in
                zip(self.allowed, self.bad_words, self.min_tokens, self.emitted)]

    @property
    def filtered(self) -> list[bool]:
        """Whether each request's target rows go through the logits processors: the masks, and
        top-k / top-p / min-p when sampled."""
        return [mk or (t > 0 and (k > 0 or p < 1.0 or mp > 0)) for mk, t, k, p, mp in
                zip(self.masked, self.temperature, self.top_k, self.top_p, self.min_p)]


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
