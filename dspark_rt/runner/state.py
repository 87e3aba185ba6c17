"""What lives across rounds, with one owner: the engine tells it when a request is added,
finishes, is aborted or preempted; nothing else adds or drops an entry.

Deferred drafter context. Under a policy that may decode plainly for many rounds (auto:
defers_context), a request that drafts nothing in a round does not pay the drafter context
update (DESIGN §2 step 7): the state keeps that request's target features (rows of the verify
forward's output) and the round writes their context in one go, right before the request drafts
again. Meanwhile the request's ctx_len stays where its context ends (RoundResult.context tells
the engine), so the prefix cache only ever shares drafter pages whose context is written.

The policy's per-request memory (auto's survival estimates) is the policy's; the state tells it
when a request is gone (policy.forget), so it never guesses. The grammar matchers of requests
with structured output (at their committed prefixes) are the state's too.
"""
from dataclasses import replace

import torch

from ..batch import SeqBatch
from ..policies.base import BatchView
from ..structured import Constraints


class RoundState:
    """policy: the VerifyPolicy the rounds consult (told of finished requests), or None;
    defers: whether requests that draft nothing keep their context update for later;
    constraints: the grammar matchers of requests with structured output (structured/walk.py)."""

    # a request's context is written once this many positions wait. A request that finishes
    # before it drafts again never pays for it (under load, most of them). Deferred rows keep
    # their round's features tensor alive; in plain rounds every row of it is deferred, so the
    # memory held is about max_deferred x (features of one token) per request
    max_deferred = 128

    def __init__(self, policy=None, defers: bool = False, constraints: Constraints | None = None):
        self.policy, self.defers = policy, defers
        self.constraints = constraints if constraints is not None else Constraints()
        self.live: set = set()
        self.deferred: dict = {}  # request id -> [(features [N, F], row)] of ctx_len .. kv_len-1

    # -- the engine's notifications ------------------------------------------------------------

    def add(self, request_id) -> None:
        self.live.add(request_id)

    def finish(self, request_id) -> None:
        """Finished or aborted: everything kept for it goes."""
        self.live.discard(request_id)
        self.deferred.pop(request_id, None)
        self.constraints.drop(request_id)
        if self.policy is not None:
            self.policy.forget(request_id)

    abort = finish

    def preempt(self, request_id) -> None:
        """Its caches are freed and recomputed from the tokens (drafter context included): the
        deferred features describe nothing any more. The policy keeps what it learnt."""
        self.deferred.pop(request_id, None)

    # -- the round's -----------------------------------------------------------------------------

    def view(self, batch: SeqBatch, gamma: int) -> BatchView:
        """What the policy decides on: request ids, drafts each request may verify (none when it
        opted out of speculation; the batch's caps keep its target token within max_tokens and
        the context) and the positions each would write before drafting."""
        caps = tuple(min(c, gamma) if s else 0 for c, s in zip(batch.caps, batch.sampling.speculative))
        return BatchView(None if batch.ids is None else tuple(batch.ids), caps,
                         tuple(self.waiting(batch)), gamma)

    def waiting(self, batch: SeqBatch) -> list[int]:
        """Per request, the positions whose drafter context is deferred; checks that the state
        holds exactly those (a request the engine never added, or a mismatch, is a bug)."""
        if batch.ids is None:
            return [0] * len(batch)
        out = []
        for rid, kv, ctx in zip(batch.ids, batch.kv_lens, batch.ctx_lens):
            if rid not in self.live:
                raise RuntimeError(f"round state: request {rid} was never added (Engine.add)")
            held = len(self.deferred.get(rid, ()))
            if held != kv - ctx:
                raise RuntimeError(f"round state: request {rid} has {kv - ctx} positions without "
                                   f"drafter context, the state holds {held}")
            out.append(held)
        return out

    def catch_up(self, runner, batch: SeqBatch, caps: list[int]) -> SeqBatch:
        """Writes the deferred drafter context of every request about to draft (one context
        update for all of them); returns the batch with their ctx_len at kv_len."""
        rows = [i for i, c in enumerate(caps) if c > 0 and batch.ids is not None
                and batch.ids[i] in self.deferred]
        if not rows:
            return batch
        self._write(runner, batch, rows)
        ctx = list(batch.ctx_lens)
        for i in rows:
            ctx[i] = batch.kv_lens[i]
        return replace(batch, ctx_lens=ctx)

    def commit(self, runner, batch: SeqBatch, accepted: list[int], failed: list[bool], cu_rows,
               feats, drafted: list[bool]) -> list[bool]:
        """Target features of the anchor and the accepted drafts (positions kv_len .. kv_len + a)
        into the drafter's context, for every request that did not fail; kept instead (deferred)
        for a request that drafted nothing, when the state defers, or whose context is deferred
        already. A request that stops inside them gets them too: it frees its pages right after,
        unread. Returns, per request, whether its context is written."""
        R = len(batch)
        if runner.drafter is None:
            return [True] * R
        ids, deferred = batch.ids, self.deferred
        ok, keep = [], []  # one pass: every round runs it for every request
        for i, f in enumerate(failed):
            if f:
                continue
            if ids is not None and not drafted[i] and (self.defers or ids[i] in deferred):
                keep.append(i)
            else:
                ok.append(i)
        if ok:
            runner.context_update([batch.drafter_pages[i] for i in ok], [batch.kv_lens[i] for i in ok],
                                  [accepted[i] + 1 for i in ok], feats, [cu_rows[i] for i in ok])
        full = []
        for i in keep:
            held, row, a = deferred.setdefault(ids[i], []), cu_rows[i], accepted[i]
            held.extend([(feats, row + k) for k in range(a + 1)])
            if len(held) >= self.max_deferred:
                full.append(i)
        if full:
            self._write(runner, batch, full)
        written = [False] * R
        for i in ok + full:
            written[i] = True
        return written

    def _write(self, runner, batch: SeqBatch, rows: list[int]):
        """The drafter context of the positions ctx_len.. the state holds for requests rows, in
        one context update; it then holds nothing for them."""
        held = [self.deferred.pop(batch.ids[i]) for i in rows]
        starts = [0]
        for h in held[:-1]:
            starts.append(starts[-1] + len(h))
        runner.context_update([batch.drafter_pages[i] for i in rows], [batch.ctx_lens[i] for i in rows],
                              [len(h) for h in held], _gather([f for h in held for f in h]), starts)


def _gather(held: list) -> torch.Tensor:
    """The rows [(features [N, F], row), ...] stacked in order: one gather per features tensor."""
    groups: dict = {}
    for j, (t, row) in enumerate(held):
        groups.setdefault(id(t), (t, [], []))
        groups[id(t)][1].append(row)
        groups[id(t)][2].append(j)
    first = held[0][0]
    out = first.new_empty((len(held), first.shape[1]))
    for t, rows, dest in groups.values():
        idx = torch.tensor([rows, dest], dtype=torch.int64).to(t.device, non_blocking=True)
        out[idx[1]] = t[idx[0]]
    return out
