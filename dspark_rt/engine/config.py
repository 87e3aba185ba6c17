"""Sizes and switches of an Engine, checked once."""
from dataclasses import dataclass


@dataclass
class EngineConfig:
    """num_pages: KV pages of each cache (target and drafter), of the runner's page_size tokens.
    max_num_seqs: requests running at once. max_num_batched_tokens: target tokens per step
    (prefill chunks, plus 1 + gamma per decoding request). chunk_size: most prompt tokens of one
    request per step. watermark: share of pages kept free when admitting while others run.
    enable_prefix_caching: share full pages of equal token prefixes."""
    num_pages: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    chunk_size: int = 256
    watermark: float = 0.01
    enable_prefix_caching: bool = True

    def __post_init__(self):
        for name in ("num_pages", "max_num_seqs", "max_num_batched_tokens", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
            raise ValueError(f"EngineConfig.watermark must lie in [0, 1), got {w!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineConfig.enable_prefix_caching must be a bool, got "
                             f"{self.enable_prefix_caching!r}")


@dataclass(frozen=True)
class EngineLimits:
    """Caps on what Engine.reserve sizes for each batch (None: sized to the batch alone); the
    Decoder sets them from vLLM's engine arguments. max_num_seqs: requests running at once (the
    others wait); max_num_batched_tokens: target tokens per step (and per prefill chunk);
    max_num_pages: KV pages per cache (gpu_memory_utilization); num_speculative_tokens: drafts
    a request verifies per round at most (a cap that no drawn token moves: lossless)."""
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_pages: int | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        for name, v in vars(self).items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"EngineLimits.{name} must be None or a positive int, got {v!r}")

    def cap(self, name: str, value: int) -> int:
        limit = getattr(self, name)
        return value if limit is None else min(value, limit)
