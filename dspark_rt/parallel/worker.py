"""A worker rank's loop: load this rank's shards, then run the leader's commands until "stop".

The commands are the Runner calls that reach the models (parallel/runner.py); the worker runs
the same ParallelRunner code on its shard and drops the results (the leader's drive the engine).
Any failure ends the process with a traceback on stderr and a non-zero exit code: the leader's
next collective then fails and it reports this rank (launch.py), rather than waiting forever.
"""
import json
import os
import resource
import sys
import traceback

import torch
import torch.distributed as dist

from .comm import TPGroup
from .layers import load_drafter, load_target
from .runner import ParallelRunner

__all__ = ["serve", "memory_stats", "worker_main", "exit_now"]


def memory_stats(target, drafter, runners) -> dict:
    """Bytes this rank holds: weights (each tensor once), KV caches; peak RSS of the process."""
    seen, weights = set(), 0
    for m in (target, drafter):
        if m is None:
            continue
        for t in list(m.parameters()) + list(m.buffers()):
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
    caches = sum(c.k_all.numel() * c.k_all.element_size() * 2 for r in runners.values()
                 for c in (r.tcache, r.dcache) if c is not None)
    return {"weights": weights, "kv_caches": caches,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def serve(group: TPGroup, spec: dict):
    """The loop of a worker rank (group.rank > 0), over the process group already set up."""
    device = torch.device(spec["device"])
    target = load_target(spec["target"], spec["dtype"], device, group)
    drafter = load_drafter(spec["drafter"], target, group) if spec["drafter"] else None
    runners = {}
    while True:
        cmd, *args = group.receive()
        if cmd == "stop":
            return
        if cmd == "stats":
            group.gather({**memory_stats(target, drafter, runners),
                          "traffic": group.traffic.as_dict()})
        elif cmd == "runner":
            rid, mode, page_size = args
            runners[rid] = ParallelRunner(target, drafter, mode, page_size, device, group, rid)
        else:
            rid, *rest = args
            getattr(runners[rid], {"round": "run_round"}.get(cmd, cmd))(*rest)


def exit_now(code: int):
    """Ends a worker process without interpreter teardown: destroying torch.distributed's
    background threads there aborts the process now and then ("terminate called without an
    active exception"), which would turn a clean stop into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(rank: int, size: int, port: int, spec: str):
    """Entry point of a worker process (launch.py); spec: JSON of the launch spec."""
    try:
        spec = json.loads(spec)
        torch.set_num_threads(spec["threads"])
        if spec["device"].startswith("cuda"):
            spec = {**spec, "device": f"cuda:{rank}"}
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
        store.set(f"up{rank}", "1")
        dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=size)
        control = dist.new_group(backend="gloo") if spec["backend"] != "gloo" else None
        serve(TPGroup(rank, size, control), spec)
        dist.destroy_process_group()
        exit_now(0)
    except BaseException:
        sys.stderr.write(f"dspark_rt tensor-parallel worker rank {rank}:\n{traceback.format_exc()}")
        exit_now(1)
