"""Exact mode: whether the target's forward runs row-invariant (DESIGN §6), the one switch the
models and verify_attention read."""
import os

import torch


def exact_mode(device) -> bool:
    """Whether the target's forward on `device` runs row-invariant (DESIGN §6): ops.linear for
    every projection and verify_attention without batch-dependent splits, so speculative greedy
    output equals plain greedy output bit for bit in every dtype. DSPARK_EXACT=1 / 0 forces it;
    by default on for the CPU (where it is measured no slower) and off on CUDA until a GPU run
    has measured its cost (README, "Exactness")."""
    env = os.environ.get("DSPARK_EXACT")
    if env is None or env == "":
        return device.type == "cpu" if isinstance(device, torch.device) \
            else torch.device(device).type == "cpu"
    if env not in ("0", "1"):
        raise ValueError(f"DSPARK_EXACT must be 0 or 1, got {env!r}")
    return env == "1"


def batch_invariant(device):
    """verify_attention never splits the KV range on CUDA, so a request's result is
    bit-identical whatever else is in the batch and however many rows its chain has: under
    exact mode, or DSPARK_ATTN_BATCH_INVARIANT=1."""
    return (os.environ.get("DSPARK_ATTN_BATCH_INVARIANT", "0") not in ("", "0")
            or exact_mode(device))
