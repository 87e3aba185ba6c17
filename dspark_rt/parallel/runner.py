"""The Runner of one tensor-parallel rank.

Every rank runs the same Runner and Round code on the same SeqBatch: the leader (rank 0, in the
engine's process) sends each call that reaches the models (allocate_caches, prefill, a round) to
the workers before running it itself, and the sharded models' collectives keep the ranks in step.
Every value the round reads to the host (confidences, accepted counts and tokens) is the
leader's, broadcast, and so are the policy's decisions: the leader sends each round's Decision
with the command and broadcasts the verify lengths its policy chooses (decided()), so the ranks
cannot disagree on a length or a token even where a reduction order could round differently,
and no policy or round state travels. Philox keys come in the
SeqBatch, so a seeded request draws what it draws in one process. The workers' round results
are discarded: the leader's drive the engine.
"""
from contextlib import contextmanager

from ..runner.runner import Runner
from .comm import TPGroup

__all__ = ["ParallelRunner", "WorkerError"]


class WorkerError(RuntimeError):
    """A tensor-parallel worker process died or failed; the group can run nothing more."""


class ParallelRunner(Runner):
    use_graphs = False  # the forwards run eagerly: collectives are not captured in CUDA graphs
    defers_context = False  # the workers hold no round state: nothing is deferred

    def __init__(self, target, drafter, mode: str, page_size: int, device, group: TPGroup,
                 runner_id: int = 0, tensor_parallel=None):
        super().__init__(target, drafter, mode, page_size, device)
        self.group, self.runner_id = group, runner_id
        # leader: the launch.TensorParallel that turns a failed collective into WorkerError
        self.tensor_parallel = tensor_parallel
        self._agree = 0

    @contextmanager
    def _leading(self, command: str, *args):
        """Leader: sends the command, then runs it; workers: run it. Host reads inside agree."""
        self._agree += 1
        self.group.active += 1
        try:
            if self.group.leader:
                self.group.send((command, self.runner_id) + args)
            yield
        except (Exception, KeyboardInterrupt) as e:  # Ctrl-C too: the workers are out of step
            # (not GeneratorExit: a generator closed around a call, at exit too, is no failure)
            if self.tensor_parallel is not None:
                self.tensor_parallel.failed(e)  # raises WorkerError unless e is an interrupt
            raise
        finally:
            self._agree -= 1
            self.group.active -= 1

    def to_host(self, t):
        if self._agree:  # inside a command: every rank reads the leader's values
            t = self.group.broadcast(t)
        return super().to_host(t)

    def allocate_caches(self, num_pages: int):
        with self._leading("allocate_caches", num_pages):
            super().allocate_caches(num_pages)

    def prefill(self, batch, starts, ends, tokens, shared=None, every_row=None):
        with self._leading("prefill", batch, starts, ends, tokens, shared, every_row):
            return super().prefill(batch, starts, ends, tokens, shared, every_row)

    def run_round(self, round_, batch, decision, policy, calibration, state):
        # the workers get the round's decision, never the policy or the round state: a policy's
        # lengths reach them through decided()
        with self._leading("round", round_, batch, decision, None, calibration, None):
            return round_(self, batch, decision, policy, calibration, state)

    def decided(self, fn, like):
        if self.group.leader:
            return self.group.broadcast(fn().to(like.dtype).reshape(like.shape))
        return self.group.broadcast(like.clone())
