"""Shared by the tensor-parallel tests: prompts, the one live group of this process, Decoders
over it and their single-process twins. A process holds one group at a time (it owns the default
process group), so group() stops the previous one first; launching one costs seconds here (fresh
interpreters importing torch), so tests reuse it."""
import os
from pathlib import Path

import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.parallel import TensorParallel
from dspark_rt.policies.sps import SPSProfile

PROMPTS = [[5], [3, 17, 42, 8, 9, 11, 2], [60, 61], list(range(10, 31)), [7, 7, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SPS = SPSProfile.from_pairs({B: 1000.0 / (1.0 + B / 4.0) for B in range(1, 129)})

_live = {}


def group(key, target, drafter) -> TensorParallel:
    """The one live 2-rank float64 CPU group of this process, for (target, drafter)."""
    if key not in _live:
        stop_all()
        _live[key] = TensorParallel(2, target, drafter, torch.float64, "cpu")
    return _live[key]


def stop_all():
    for key in list(_live):
        _live.pop(key).shutdown()


def kw(mode, policy) -> dict:
    out = dict(mode=mode, policy=policy, threshold=0.3)
    if policy in ("sync", "async"):
        out["sps"] = SPS
    if policy == "auto":
        out["sps"] = (SPS, SPS, SPS)  # speculative, plain and no-draft rounds
    return out


def single(pair, mode, policy) -> Decoder:
    return Decoder.from_pretrained(pair[0], None if mode == "ar" else pair[1], dtype="float64",
                                   **kw(mode, policy))


def parallel(key, pair, mode, policy) -> Decoder:
    """A Decoder over the live group of `pair` (a fresh runner on both ranks)."""
    g = group(key, *pair)
    return Decoder(g.target, g.drafter, None, tensor_parallel=g, **kw(mode, policy))


def script_env() -> dict:
    """The environment of a subprocess that imports this checkout's dspark_rt."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


# fixtures of both tensor-parallel test files (imported there by name)
@pytest.fixture(scope="module", autouse=True)
def _stop_groups():
    yield
    stop_all()


@pytest.fixture(scope="module")
def pair(tiny_target, tiny_drafters):
    return tiny_target, tiny_drafters("vanilla", 4)
