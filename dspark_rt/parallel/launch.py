"""Starting and stopping a tensor-parallel group from the engine's process.

One node: the caller is rank 0 (the leader: the Engine and its sharded models), and
TensorParallel starts ranks 1 .. N-1 as worker processes (fresh interpreters) that
meet it over a TCP store on a free localhost port; torch.distributed runs NCCL on CUDA (rank r
on cuda:r) and gloo on the CPU. Several nodes: torchrun starts every rank (README); rank 0
returns from from_pretrained with the Decoder, the other ranks serve it and exit when it shuts
down (_join_torchrun).
A worker that dies makes the leader's next collective fail; the leader then names the rank and
its exit code (WorkerError) and stops the others: the caller sees an error, not a hang.
"""
import atexit
import json
import os
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import DrafterConfig, TargetConfig
from .comm import TPGroup
from .layers import load_drafter, load_target
from .runner import ParallelRunner, WorkerError
from .shard import Shard
from .worker import exit_now, memory_stats, serve

__all__ = ["TensorParallel", "WorkerError"]

START_TIMEOUT_S = 600  # workers import torch and load their shards (slow on a loaded machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


class TensorParallel:
    """The leader's side of a group of `size` ranks over the model pair (target, drafter folders):
    its sharded models (target, drafter), runner(...) for the Decoder, stats(), shutdown()."""

    def __init__(self, size: int, target: str, drafter: str | None, dtype: torch.dtype, device):
        device = torch.device(device)
        if size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2 here, got {size}")
        # shapes that do not split fail here, before any process starts
        tcfg = TargetConfig.from_json(target)
        Shard(tcfg, 0, size)
        if drafter:
            Shard(DrafterConfig.from_json(drafter, allow_dflash2=True).model, 0, size)
        self.size, self.procs, self.runners, self.closed, self.why = size, [], {}, False, ""
        backend = "nccl" if device.type == "cuda" else "gloo"
        spec = {"target": str(target), "drafter": str(drafter) if drafter else None,
                "dtype": str(dtype).removeprefix("torch."), "device": device.type,
                "backend": backend, "threads": max(1, (os.cpu_count() or 1) // size)}
        if _torchrun():
            self._join_torchrun(spec, device)
        else:
            self._spawn(spec)
        control = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.group = TPGroup(0, size, control)
        self.group.watch = self.check
        try:
            self.target = load_target(target, dtype, device, self.group)
            self.drafter = load_drafter(drafter, self.target, self.group) if drafter else None
        except BaseException:
            self.shutdown()
            raise
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())

    def _spawn(self, spec: dict):
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel group (or another user of torch.distributed's "
                               "default process group) is live in this process: shut its "
                               "Decoder down first (one tensor-parallel Decoder per process)")
        port = _free_port()
        store = dist.TCPStore("127.0.0.1", port, self.size, is_master=True,
                              wait_for_workers=False)
        # fresh interpreters (not multiprocessing's spawn, which re-runs the caller's __main__):
        # they import only dspark_rt, found where this process found it
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        for rank in range(1, self.size):
            code = ("from dspark_rt.parallel.worker import worker_main; "
                    f"worker_main({rank}, {self.size}, {port}, {json.dumps(spec)!r})")
            self.procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank in range(1, self.size):  # wait for each worker, watching that it still lives
            while not store.check([f"up{rank}"]):
                self.check()
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise WorkerError(f"tensor-parallel worker rank {rank} did not start within "
                                      f"{START_TIMEOUT_S} s")
                time.sleep(0.05)
        dist.init_process_group(spec["backend"], store=store, rank=0, world_size=self.size)
        self._store = store

    def _join_torchrun(self, spec: dict, device):
        """Under torchrun every rank calls from_pretrained: rank 0 leads, the others serve it
        here and exit the process when it shuts down."""
        if not dist.is_initialized():
            dist.init_process_group(spec["backend"])
        rank, size = dist.get_rank(), dist.get_world_size()
        if size != self.size:
            raise ValueError(f"tensor_parallel_size={self.size} but torchrun started {size} ranks")
        if rank == 0:
            return
        local = int(os.environ.get("LOCAL_RANK", rank))
        if spec["device"] == "cuda":
            torch.cuda.set_device(local)
            spec = {**spec, "device": f"cuda:{local}"}
        control = dist.new_group(backend="gloo") if spec["backend"] != "gloo" else None
        serve(TPGroup(rank, size, control), spec)
        dist.destroy_process_group()
        exit_now(0)

    # -- for the Decoder -----------------------------------------------------------------------

    def runner(self, target, drafter, mode: str, page_size: int, device) -> ParallelRunner:
        """A ParallelRunner here and its twin on every worker."""
        rid = len(self.runners)
        self.group.send(("runner", rid, mode, page_size))
        self.runners[rid] = ParallelRunner(target, drafter, mode, page_size, device, self.group,
                                           rid, tensor_parallel=self)
        return self.runners[rid]

    def stats(self) -> list[dict]:
        """Per rank: weight bytes, KV-cache bytes, peak RSS, and the collectives' traffic."""
        self.group.send(("stats",))
        mine = {**memory_stats(self.target, self.drafter, self.runners), "traffic": self.group.traffic.as_dict()}
        return self.group.gather(mine)

    # -- failures and shutdown ---------------------------------------------------------------

    def check(self):
        """Raises WorkerError when the group is closed or a worker has exited."""
        if self.closed:
            raise WorkerError(f"the tensor-parallel group is shut down{self.why}")
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                self.shutdown()
                raise WorkerError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with "
                                  f"code {p.poll()}; the group is shut down")

    def failed(self, error: BaseException):
        """A call failed on the leader. The ranks are out of step from then on, so the group
        stops; the error names a dead worker when one is the cause (it usually is: a peer that
        is gone fails the leader's collective), else the leader's own failure. An interrupt
        (KeyboardInterrupt, SystemExit) stops the group at once and returns, so the caller
        re-raises it; the next call then raises WorkerError naming it."""
        if isinstance(error, WorkerError):
            raise error
        if not isinstance(error, Exception):
            self.why = (f" ({type(error).__name__} interrupted a call the ranks run together; "
                        "build a new Decoder)")
            self.shutdown(stop=False)  # the workers sit in a collective: kill them
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        dead = [(r, p) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        self.shutdown(stop=False)  # the workers may sit in a collective: no command reaches them
        if dead:
            r, p = dead[0]
            raise WorkerError(f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code "
                              f"{p.returncode}; the group is shut down") from error
        raise WorkerError(f"tensor-parallel rank 0 failed inside a call the ranks run together "
                          f"({type(error).__name__}: {error}); the group is shut down") from error

    def shutdown(self, stop: bool = True):
        """Stops the workers (stop=False: kills them) and leaves the process group; idempotent."""
        if self.closed:
            return
        self.closed = True
        alive = all(p.poll() is None for p in self.procs)
        group = getattr(self, "group", None)
        if stop and alive and group is not None:
            group.watch = None
            try:
                group.send(("stop",))
            except Exception:
                alive = False
        else:
            alive = False
        for p in self.procs:
            try:
                p.wait(timeout=30 if alive else 0.5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if dist.is_initialized():
            if alive:
                dist.destroy_process_group()
            else:  # a peer is gone: a collective teardown could block; drop the group locally
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass
        self._store = None  # the TCP store's server thread stops now, not at interpreter exit
