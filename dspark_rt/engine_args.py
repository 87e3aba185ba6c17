"""The Decoder's engine arguments, checked by name: the device and seed, and vLLM's engine
arguments (max_model_len, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
enforce_eager, num_speculative_tokens) turned into the runner's context cap and the Engine's
limits (engine.config.EngineLimits). docs/vllm.md maps every vLLM engine argument."""
import numbers
import os
from dataclasses import dataclass

import torch

from .engine.config import EngineLimits


def device(value) -> torch.device:
    try:
        value = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {value!r} ({e})") from None
    if value.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(value)!r}: no CUDA device is available here "
                         "(torch.cuda.is_available() is False); use device='cpu'")
    if value.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(value)!r}")
    return value


def seed(value) -> int:
    if not _int(value) or not 0 <= value < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {value!r}")
    return int(value)


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class EngineArgs:
    """vLLM's engine arguments, None (False) where not given. max_model_len: the context (prompt
    + output) in tokens, at most the target's max_position_embeddings. gpu_memory_utilization:
    the share of the device's memory this process may use in all (what is in use when the models
    are loaded, theirs included, counts against it; on the CPU the host's memory, MemTotal
    less MemAvailable in use); the KV pool grows with the batches up to what is left (without
    it, to every batch's need). max_num_seqs, max_num_batched_tokens: requests running at once
    and target tokens per step. enforce_eager: no CUDA graphs. num_speculative_tokens: drafts
    verified per round at most (<= the drafter's gamma)."""
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "num_speculative_tokens"):
            v = getattr(self, name)
            if v is not None and (not _int(v) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        u = self.gpu_memory_utilization
        if u is not None and (not isinstance(u, numbers.Real) or isinstance(u, bool)
                              or not 0.0 < u <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")

    def apply(self, runner) -> EngineLimits:
        """Caps the runner's context and drops its CUDA graphs as asked; the Engine's limits."""
        positions = runner.max_len
        if self.max_model_len is not None:
            if not 2 <= self.max_model_len <= positions:
                raise ValueError(f"max_model_len must lie in [2, {positions}] (the target's "
                                 f"max_position_embeddings), got {self.max_model_len}")
            runner.max_len = int(self.max_model_len)
        if self.enforce_eager:
            runner.graphs = None  # the forwards run eagerly (captures happen on first use only)
        k = self.num_speculative_tokens
        if k is not None and k > runner.gamma:
            raise ValueError(f"num_speculative_tokens must be at most the drafter's gamma "
                             f"({runner.gamma}: drafts per block), got {k}" if runner.gamma else
                             f"num_speculative_tokens={k} needs a drafter (mode {runner.mode!r} "
                             "drafts nothing)")
        tokens = self.max_num_batched_tokens
        if tokens is not None and tokens < 1 + runner.gamma:
            raise ValueError(f"max_num_batched_tokens must hold one round of a request, 1 + gamma "
                             f"= {1 + runner.gamma} tokens, got {tokens}")
        pages = None
        if self.gpu_memory_utilization is not None:
            pages = kv_pages(self.gpu_memory_utilization, runner)
        return EngineLimits(self.max_num_seqs, tokens, pages, k)


def device_memory(dev) -> tuple[int, int]:
    """(free, total) bytes of the device: torch.cuda.mem_get_info on CUDA; on the CPU the host's
    MemAvailable and MemTotal (/proc/meminfo, else sysconf)."""
    dev = torch.device(dev)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def page_bytes(runner) -> int:
    """Bytes of one KV page across the target's and the drafter's caches (this rank's share
    under tensor parallelism)."""
    total = 0
    for model in (runner.target, runner.drafter):
        if model is not None:
            cache = model.make_cache(1, runner.page_size)
            total += cache.k_all.nbytes + cache.v_all.nbytes
    return total


def kv_pages(utilization: float, runner) -> int:
    """KV pages per cache that utilization x the device's memory holds beyond what is in use."""
    free, total = device_memory(runner.device)
    room = int(utilization * total) - (total - free)
    per_page = page_bytes(runner)
    if room < per_page:
        raise ValueError(f"gpu_memory_utilization={utilization:g}: {(total - free) / 2**30:.3g} "
                         f"of the {runner.device.type} device's {total / 2**30:.3g} GiB are in "
                         f"use (the models included), more than {utilization:g} of it leaves "
                         f"for the KV cache (a page takes {per_page} bytes); raise it")
    return room // per_page
