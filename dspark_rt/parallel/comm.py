"""The tensor-parallel group of one model pair: its collectives and the leader's command channel.

Tensors move on the default process group (NCCL on CUDA, gloo on the CPU); commands (pickled
Python objects: a SeqBatch, a policy) move on a gloo group, so they never touch the GPU. Every
collective counts the bytes it moves, so a run can be set against the floor (README, "Tensor
parallelism").
"""
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "Traffic"]


@dataclass
class Traffic:
    """Payload bytes one rank handed to collectives (its own tensor, not the wire bytes of the
    algorithm: a ring all-reduce of n bytes puts 2 (N-1)/N n on the wire per rank)."""
    all_reduce: int = 0
    all_gather: int = 0
    broadcast: int = 0
    commands: int = 0
    calls: dict = field(default_factory=dict)

    def add(self, kind: str, n: int):
        setattr(self, kind, getattr(self, kind) + n)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def as_dict(self) -> dict:
        return {"all_reduce": self.all_reduce, "all_gather": self.all_gather,
                "broadcast": self.broadcast, "commands": self.commands, "calls": dict(self.calls)}


class TPGroup:
    """rank / size of this process in the group; the collectives the sharded models call."""

    def __init__(self, rank: int, size: int, control=None):
        self.rank, self.size = rank, size
        self.control = control  # gloo group of the commands (None: the default group is gloo)
        self.traffic = Traffic()
        self.watch = None  # leader: raises when a worker is gone (launch.TensorParallel.check)
        self.active = 0  # > 0 inside a command every rank runs (ParallelRunner)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- inside the model forwards -----------------------------------------------------------

    def _in_step(self, what: str):
        """A sharded forward outside a command would wait forever for the other ranks: a plain
        Runner (the profiler's, a test's) over a tensor-parallel Decoder's models."""
        if not self.active:
            raise RuntimeError(f"tensor-parallel {what} outside a ParallelRunner call: the sharded "
                               "models of a tensor-parallel Decoder run only through its runner")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of x (the partial products of a row-parallel layer), in place."""
        self._in_step("all_reduce")
        x = x.contiguous()
        self.traffic.add("all_reduce", x.numel() * x.element_size())
        dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank-major (vocabulary shards in order)."""
        self._in_step("all_gather")
        x = x.contiguous()
        self.traffic.add("all_gather", x.numel() * x.element_size())
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The leader's x on every rank (x has the same shape and dtype everywhere); bytes, so
        any dtype travels."""
        x = x.contiguous().clone()
        raw = x.view(-1).view(torch.uint8) if x.numel() else x.view(torch.uint8)
        self.traffic.add("broadcast", raw.numel())
        dist.broadcast(raw, src=0)
        return x

    # -- commands ----------------------------------------------------------------------------

    def send(self, command: tuple):
        """Leader: one command to every worker."""
        if self.watch is not None:
            self.watch()
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._bytes(torch.tensor([len(data)], dtype=torch.int64))
        self._bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.traffic.add("commands", len(data) + 8)

    def receive(self) -> tuple:
        """Worker: the leader's next command."""
        n = torch.zeros(1, dtype=torch.int64)
        self._bytes(n)
        buf = torch.empty(int(n), dtype=torch.uint8)
        self._bytes(buf)
        return pickle.loads(buf.numpy().tobytes())

    def gather(self, obj):
        """Every rank's obj, at the leader (a list by rank); None elsewhere."""
        out = [None] * self.size if self.leader else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def _bytes(self, t: torch.Tensor):
        dist.broadcast(t, src=0, group=self.control)
