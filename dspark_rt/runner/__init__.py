"""The worker layer: Runner (model pair, KV caches, forwards), the Round it runs (DESIGN §2),
CUDA graphs per bucket, and the profiler of its rounds' throughput SPS(B).

Names load lazily, so that the engine's pure-Python bookkeeping can import runner.batch (the
SeqBatch and the page count) without torch models or the extension."""
import importlib

_NAMES = {"MODES": "runner", "Runner": "runner", "Round": "round", "RoundResult": "round",
          "first_token": "round", "SeqBatch": "batch", "pages_for": "batch"}


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_NAMES)
