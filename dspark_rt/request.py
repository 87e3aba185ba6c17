"""State of one request between rounds."""
from dataclasses import dataclass, field

from .outputs import SpecMetrics
from .sampling_params import SamplingParams


@dataclass
class Request:
    """Positions 0 .. kv_len-1 are committed and in the target's KV cache; `anchor` is the last
    emitted token, at position kv_len, not yet in the cache. ctx_len positions have drafter
    context (equal to kv_len between rounds)."""
    request_id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int          # uint64 Philox key
    stream: int        # Philox stream id (0 for a request with its own seed)
    metrics: SpecMetrics
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kv_len: int = 0
    ctx_len: int = 0
    round: int = 0
    anchor: int = -1
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    text: str = ""
    detok: object = None  # tokenizer.IncrementalText, when stop strings are checked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
