"""BENCHMARK ONLY: seconds per round step, by wrapping the engine's Round.

    times = phases.install(decoder)   # {"draft": s, "schedule": s, ...}, accumulating
    decoder.generate(...)
    phases.uninstall(decoder)

Each step costs one device synchronisation before and after it on a GPU (nothing on the CPU), so
a benchmark times phases in a separate pass there. Steps: draft (block forward, LM head,
sequential and confidence heads: one CUDA graph on a GPU), schedule (verify lengths and the
verify batch), verify_forward, accept (rejection sampling and the round's host read),
context_update.
"""
import time

import torch

from ..runner.round import Round

PHASES = {"draft": "draft", "schedule": "schedule", "verify": "verify_forward",
          "accept": "accept", "commit_context": "context_update", "catch_up": "context_update"}


class TimedRound(Round):
    """inner's steps, each timed into `times` (seconds, summed over rounds)."""

    def __init__(self, inner: Round, times: dict):
        self.inner, self.times = inner, times
        for method, phase in PHASES.items():
            setattr(self, method, self._timed(getattr(inner, method), phase))

    def _timed(self, fn, phase):
        def run(runner, *args):
            sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            out = fn(runner, *args)
            sync()
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0
            return out
        return run


def install(decoder) -> dict:
    """Times every later round of the Decoder's engine; returns the dict it fills."""
    times: dict[str, float] = {}
    decoder.engine.round = TimedRound(decoder.engine.round, times)
    return times


def uninstall(decoder):
    """Back to the untimed round (the one install wrapped)."""
    r = decoder.engine.round
    if isinstance(r, TimedRound):
        decoder.engine.round = r.inner
