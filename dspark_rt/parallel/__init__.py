"""Tensor parallelism over torch.distributed: the target sharded Megatron-style across ranks, the
drafter's backbone at the target's TP, its heads replicated; one leader (the engine's process)
and workers that run the same Runner code on their shards (launch.py, worker.py)."""
from .launch import TensorParallel
from .runner import ParallelRunner, WorkerError

__all__ = ["TensorParallel", "ParallelRunner", "WorkerError"]
