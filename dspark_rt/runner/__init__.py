"""The worker layer: Runner (model pair, KV caches, forwards), the Round it runs (DESIGN §2), the
RoundState that lives across rounds, CUDA graphs per bucket, and the profiler of its rounds'
throughput SPS(B). The batch it reads (SeqBatch, pages_for) is a plain type at the bottom of the
package (dspark_rt/batch.py)."""
from .round import Round, RoundResult, first_token
from .runner import MODES, Runner
from .state import RoundState

__all__ = ["MODES", "Round", "RoundResult", "RoundState", "Runner", "first_token"]
