"""How many KV pages `dspark-rt serve` allocates: as many as a memory budget holds (vLLM's way),
never more than max_num_seqs whole contexts, and an error naming the flags when not even one
context fits.

The budget is --kv-cache-memory bytes, or --kv-cache-fraction of the memory available once the
models are loaded: on CUDA the device's free memory (torch.cuda.mem_get_info), on the CPU
MemAvailable (psutil when installed, else /proc/meminfo). A page costs the same in both caches'
layers: K and V of page_size tokens of every target and drafter layer.
"""
import os

import torch

DEFAULT_FRACTION = {"cuda": 0.9, "cpu": 0.5}  # the CPU's memory also holds the rest of the host


def available_bytes(device) -> int:
    """Memory free for the KV caches now: the CUDA device's free bytes, or the host's
    MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def page_bytes(runner) -> int:
    """Bytes one page takes across the target's and the drafter's caches (this rank's share
    under tensor parallelism): measured on a one-page cache of each."""
    total = 0
    for model in (runner.target, runner.drafter):
        if model is not None:
            cache = model.make_cache(1, runner.page_size)
            total += cache.k_all.nbytes + cache.v_all.nbytes
    return total


def gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def budget_pages(runner, device, *, per_seq: int, max_num_seqs: int, max_model_len: int,
                 kv_cache_memory: int | None = None, kv_cache_fraction: float | None = None) -> int:
    """KV pages per cache for a budget of kv_cache_memory bytes, or kv_cache_fraction (default:
    DEFAULT_FRACTION by device type) of available_bytes(device); at most max_num_seqs contexts
    of per_seq pages. Raises ValueError naming the flags when one context does not fit."""
    per_page = page_bytes(runner)
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "--kv-cache-memory"
    else:
        if kv_cache_fraction is None:
            kv_cache_fraction = DEFAULT_FRACTION.get(torch.device(device).type, 0.5)
        free = available_bytes(device)
        budget = int(free * kv_cache_fraction)
        source = f"--kv-cache-fraction {kv_cache_fraction:g} of the {gib(free)} available"
    pages = budget // per_page
    if pages < per_seq:
        raise ValueError(
            f"the KV cache budget of {gib(budget)} ({source}) holds {pages} pages of "
            f"{per_page} bytes; one context of {max_model_len} tokens needs {per_seq} pages "
            f"({gib(per_seq * per_page)}): raise --kv-cache-memory or --kv-cache-fraction, "
            "or set --num-pages")
    return min(pages, max_num_seqs * per_seq)
