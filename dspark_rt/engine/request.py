"""State of one request between rounds, and who writes each field."""
from dataclasses import dataclass, field

from ..outputs import SpecMetrics
from ..sampling_params import SamplingParams


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    """Positions 0 .. kv_len-1 are committed and in the target's KV cache; the anchor (the last
    emitted token) sits at position kv_len, not yet in the cache. ctx_len positions have
    drafter context (equal to kv_len between rounds, unless ctx_deferred: the round holds the
    features of ctx_len .. kv_len-1 and writes their context before the request drafts).

    One writer per field: the fields up to metrics are set once, when the engine's Processor
    checks the request; the scheduler writes kv_len, ctx_len, ctx_deferred and the pages (RequestScheduler:
    admission, prefill and round progress, preemption); the Processor writes the output fields
    (output_ids .. detok: commit, abort, fail). The runner reads a SeqBatch copy and writes
    nothing."""
    request_id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int          # uint64 Philox key
    stream: int        # Philox stream id (0 for a request with its own seed)
    metrics: SpecMetrics
    max_tokens: int    # params.max_tokens capped by (None: all of) the context left after the prompt
    # scheduler
    kv_len: int = 0
    ctx_len: int = 0
    ctx_deferred: bool = False
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    # processor (and the engine's abort / error)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the emitted tokens' (when asked)
    logprob_ranks: list[int] = field(default_factory=list)  # ... their ranks in their rows
    top_logprobs: list[tuple] = field(default_factory=list)  # ((id, logprob), ...) per token
    round: int = 0     # rounds run, round 0 (the token after the prompt) included
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop_token_ids entry or stop string that ended it
    error: str | None = None  # why the request failed (finish_reason "error")
    grammar_complete: bool | None = None  # set when it finishes, if it asked for a grammar
    text: str | None = None  # the text cut before a stop string (None: decode output_ids)
    detok: object = None  # tokenizer.IncrementalText, when stop strings are checked
    # engine prefill (prompt_logprobs.py): per prompt position, None or {token_id: logprob}
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether the next prefill must compute every prompt position's logits (prompt
        log-probabilities asked and not yet complete): the scheduler then skips the prefix
        cache, whose hit would skip those positions."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def anchor(self) -> int:
        """The last emitted token (-1 before the first): x0 of the next round."""
        return self.output_ids[-1] if self.output_ids else -1

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output_ids)
