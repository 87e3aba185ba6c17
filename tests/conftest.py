"""Shared fixtures: tiny checkpoints written to disk in the real formats, once per session."""
import pytest
import torch

from dspark_rt import testing

TINY = dict(vocab=96, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    testing.write_tiny_target(path, seed=1, **TINY)
    return path


@pytest.fixture(scope="session")
def tiny_drafters(tmp_path_factory, tiny_target):
    """(kind, block_size) -> drafter folder. kind: a DeepSpec head type or "zlab" (1+N DFlash)."""
    cache = {}

    def get(kind: str, block_size: int):
        key = (kind, block_size)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"drafter_{kind}_{block_size}")
            common = dict(layers=1, block_size=block_size, target_layer_ids=[0, 1], seed=7,
                          share_target_layers=True)
            if kind == "zlab":
                testing.write_tiny_dflash(path, tiny_target, **common)
            else:
                testing.write_tiny_drafter(path, tiny_target, head=kind, markov_rank=8,
                                           confidence=True, confidence_markov=kind != "none",
                                           **common)
            cache[key] = path
        return cache[key]

    return get
