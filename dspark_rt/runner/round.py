"""One DSpark round for a batch of decoding requests (DESIGN §2), and round 0 after a prefill.

    draft    = runner.draft(...)            1-3. block forward, LM head, sequential + confidence head
    lengths  = policy(calibrated conf)      4.   how many drafts each request verifies
    logits   = runner.verify(chains)        5.   one ragged causal target forward
    accepted = rejection_sample(...)        6.   lossless acceptance, one host read
    runner.context_update(committed)        7.   drafter context of anchor + accepted drafts

Every step is a method, so a benchmark can replace one (dspark_rt/testing: synthetic acceptance,
phase timers) without a hook in the serving path. The round reads the device once (its results),
twice when a host-side policy (threshold, sync) needs the confidences first; a policy that
admits on the device (async) keeps the lengths there until the one read.

Deferred drafter context. A policy that may decode plainly for many rounds (auto:
policy.defers_context) does not pay step 7 in rounds where a request drafts nothing: the round
keeps that request's target features (rows of the verify forward's output, by request id) and
writes their drafter context in one go, right before the request drafts again. Meanwhile the
request's ctx_len stays where its context ends (RoundResult.context tells the engine), so the
prefix cache only ever shares drafter pages whose context is written. Features the round no
longer holds (a request left a batch and came back) are reported in RoundResult.context_lost:
the engine then rebuilds that context from the target, as after a partial prefix hit.
"""
from dataclasses import dataclass, field, replace

import torch

from .. import ops
from ..policies import Calibration, VerifyPolicy
from .batch import SeqBatch
from .runner import Draft, Runner


@dataclass
class RoundResult:
    """What one round produced, per request, on the host (one copy); logits stay on the device
    (logprobs read them)."""
    num_accepted: list[int]
    out_tokens: list[list[int]]  # x_1 .. x_a, y (the emitted tokens)
    failed: list[bool]           # NaN or +inf in one of the request's target rows
    lengths: list[int]           # drafts verified
    logits: torch.Tensor         # [N, V] target logits of the verify forward, raw (before
                                 # top-k / top-p filtering)
    cu_rows: list[int]           # [R + 1] rows of each request in logits
    conf_logit: torch.Tensor | None  # [R, gamma] raw confidence logits (dspark with a head)
    context: list[bool] = field(default_factory=list)       # drafter context written up to the
                                                            # committed positions (else deferred)
    context_lost: list[bool] = field(default_factory=list)  # deferred features dropped
    nonfinite: list[bool] = field(default_factory=list)     # rejected at a draft whose q was
                                                            # NaN / inf (a drafter's overflow)


@dataclass
class Verify:
    """Step 4's decision, and step 5's batch: ids, positions and metadata of the flat chains.
    On the device path the lengths are a device tensor until the round's read."""
    ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    lengths: list[int] | None        # host path
    cu: list[int] | None             # host path: rows of request r are cu[r] .. cu[r+1]-1
    device: tuple | None = None      # device path: (lengths [R], survival, K, source, caps)


class Round:
    """The round as a callable: Round()(runner, batch, policy, calibration) -> RoundResult.
    Between rounds it holds the deferred features of requests that decoded plainly (module
    docstring), by request id."""

    # a request's context is written once this many positions wait. A request that finishes
    # before it drafts again never pays for it (under load, most of them). Deferred rows keep
    # their round's features tensor alive; in plain rounds every row of it is deferred, so the
    # memory held is about max_deferred x (features of one token) per request
    max_deferred = 128

    def __init__(self):
        self.deferred: dict = {}  # request id -> [(features [N, F], row)] of ctx_len .. kv_len-1

    def __call__(self, runner: Runner, batch: SeqBatch, policy: VerifyPolicy,
                 calibration: Calibration) -> RoundResult:
        rng = runner.rng(batch)  # Philox keys, one upload: the head and the acceptance read them
        lost = self.held(batch)  # deferred features still held, by request
        # 1-3. block [x0, m, .., m] -> h_k, U_k = lm_head(h_k); x_k ~ q_k = softmax((U_k +
        #      bias(x_{k-1}, h_k)) / T), k = 1..gamma; confidence logits c_k. None: a plain
        #      round (no drafter, or the policy finds from earlier rounds that drafting won't pay)
        caps = self.caps(batch, runner.gamma)
        if runner.gamma and hasattr(policy, "begin_round"):
            policy.begin_round(batch.ids, [kv - c for kv, c in zip(batch.kv_lens, batch.ctx_lens)])
        speculate = runner.gamma and policy.speculates(caps, runner.gamma)
        if speculate:  # requests whose cap the policy zeroes draft nothing (AutoPolicy explores)
            caps = [0 if gone else c for c, gone in zip(policy.draft_caps(caps), lost)]
            batch = self.catch_up(runner, batch, caps)  # deferred context of those that draft
        draft = self.draft(runner, batch, rng, caps) if speculate else None
        # 4. l_r from the calibrated survivals a_k = prod c_hat_i (never from the tokens: that
        #    keeps it lossless), then the flat chains [x0, x_1 .. x_l] of every request
        plan = self.schedule(runner, batch, draft, policy, calibration, caps)
        # 5. one ragged causal target forward over all chains: P_0 .. P_l, and the features
        logits, feats = self.verify(runner, plan)
        # 6. accept x_k w.p. min(1, P_{k-1}(x_k) / q_k(x_k)); emit y from the residual
        #    max(0, P - q) at the first rejection, else the bonus y ~ P_l; one host read
        res = self.accept(runner, batch, draft, plan, logits, rng, policy)
        # 7. drafter context of the committed positions: the anchor and the accepted drafts
        #    (a request that drafted nothing, under a policy that defers: kept for later)
        drafted = [draft is not None and c > 0 for c in caps]
        res.context = self.commit_context(runner, batch, res, feats, drafted, lost,
                                          policy.defers_context and runner.defers_context)
        res.context_lost = lost
        return res

    # deferred drafter context --------------------------------------------------------------

    def held(self, batch: SeqBatch) -> list[bool]:
        """Drops the deferred features of requests not in this batch (finished, aborted,
        preempted, or only left out of it) and of requests whose held rows do not cover
        ctx_len .. kv_len-1 exactly; returns, per request, whether its deferred context is gone
        (the engine rebuilds it; until then it drafts nothing)."""
        if batch.ids is None:
            self.deferred.clear()
            return [False] * len(batch)
        here = set(batch.ids)
        for rid in [r for r in self.deferred if r not in here]:
            del self.deferred[rid]
        lost = []
        for rid, kv, ctx in zip(batch.ids, batch.kv_lens, batch.ctx_lens):
            if len(self.deferred.get(rid, ())) != kv - ctx:
                self.deferred.pop(rid, None)
                lost.append(kv > ctx)
            else:
                lost.append(False)
        return lost

    def catch_up(self, runner: Runner, batch: SeqBatch, caps: list[int]) -> SeqBatch:
        """Writes the deferred drafter context of every request about to draft (one context
        update for all of them); returns the batch with their ctx_len at kv_len."""
        rows = [i for i, c in enumerate(caps) if c > 0 and batch.ids is not None
                and batch.ids[i] in self.deferred]
        if not rows:
            return batch
        self.write_deferred(runner, batch, rows)
        ctx = list(batch.ctx_lens)
        for i in rows:
            ctx[i] = batch.kv_lens[i]
        return replace(batch, ctx_lens=ctx)

    def write_deferred(self, runner: Runner, batch: SeqBatch, rows: list[int]):
        """The drafter context of the positions ctx_len.. the round holds for requests rows, in
        one context update; the round then holds nothing for them."""
        held = [self.deferred.pop(batch.ids[i]) for i in rows]
        starts = [0]
        for h in held[:-1]:
            starts.append(starts[-1] + len(h))
        runner.context_update([batch.drafter_pages[i] for i in rows], [batch.ctx_lens[i] for i in rows],
                              [len(h) for h in held], _gather([f for h in held for f in h]), starts)

    # 1-3. parallel draft, sequential head, confidences ---------------------------------------

    def draft(self, runner: Runner, batch: SeqBatch, rng: dict, caps: list[int]) -> Draft | None:
        """Drafts of the requests that may verify one (cap > 0: SamplingParams.speculative, room
        left, not excluded by the policy); the others get empty rows and verify only their own
        token."""
        rows = [i for i, c in enumerate(caps) if c > 0]
        if len(rows) == len(batch):
            return runner.draft(batch, rng)
        if not rows:
            return None
        idx = runner.upload(rows, torch.int64)
        sub = runner.draft(batch.select(rows), {k: v[idx] for k, v in rng.items()})
        return sub.spread(rows, runner.upload(batch.anchors, torch.int64))

    # 4. verify lengths -------------------------------------------------------------------------

    def schedule(self, runner, batch, draft: Draft | None, policy, calibration, caps) -> Verify:
        """l_r in [0, caps_r] from the calibrated confidences alone (never the draft tokens:
        that keeps acceptance lossless), and the flat chains [x0, x_1 .. x_l]."""
        R, gamma = len(batch), runner.gamma
        if draft is None:  # plain decoding: the chain is the anchor
            meta, pos, cu = runner.meta(batch.target_pages, batch.kv_lens, [1] * R, True)
            return Verify(runner.upload(batch.anchors, torch.int64), pos, meta, [0] * R, cu)
        chains = torch.cat([draft.anchor[:, None], draft.tokens], 1)  # [R, gamma + 1]
        conf = self.confidences(draft)
        if policy.admits_on_device and conf is not None and not any(batch.filtered):
            _, survival = calibration.apply(conf)
            K, source = policy.next_budget(R, gamma)
            cap = runner.upload(caps, torch.int64)
            lengths = policy.admit_on_device(survival, cap, gamma, K)
            n_rows = R + min(K, sum(caps))  # the verify size, known on the host
            meta, pos, ids = runner.meta_on_device(batch, lengths, n_rows, chains)
            return Verify(ids, pos, meta, None, None, (lengths, survival, K, source, caps))
        c_hat = survival = None
        if policy.needs_confidence:
            c_hat, survival = calibration.apply(runner.to_host(conf))
        lengths = policy.lengths(c_hat, survival, torch.tensor(caps), gamma).tolist()
        # the chains are gathered on the device: drafts never visit the host
        pick = [i * (gamma + 1) + k for i, n in enumerate(lengths) for k in range(n + 1)]
        ids = chains.view(-1)[runner.upload(pick, torch.int64)]
        meta, pos, cu = runner.meta(batch.target_pages, batch.kv_lens, [n + 1 for n in lengths], True)
        return Verify(ids, pos, meta, lengths, cu)

    @staticmethod
    def caps(batch: SeqBatch, gamma: int) -> list[int]:
        """Drafts each request may verify this round (none when it opted out of speculation)."""
        return [min(c, gamma) if p.speculative else 0 for c, p in zip(batch.caps, batch.params)]

    def confidences(self, draft: Draft) -> torch.Tensor | None:
        """The raw confidence logits [R, gamma] the policy sees."""
        return draft.conf_logit

    # 5. verify forward -------------------------------------------------------------------------

    def verify(self, runner: Runner, plan: Verify):
        return runner.verify(plan.ids, plan.positions, plan.meta)

    # 6. acceptance -----------------------------------------------------------------------------

    def accept(self, runner, batch, draft, plan: Verify, logits, rng, policy) -> RoundResult:
        """Accept x_k with probability min(1, P(x_k) / q(x_k)), emit the residual (or bonus)
        token y; then the round's one host read: accepted counts, tokens, failures (and, on the
        device path, the lengths and survivals the policy plans its next budget on)."""
        raw = logits
        if plan.device is None and any(batch.filtered):
            if any(p.logprobs for p in batch.params):
                raw = logits.clone()  # logprobs are the target's raw log-probabilities
            logits = runner.filter(batch, logits, plan.cu)
        acc, out, failed = self.sample(runner, draft, plan, logits, rng)
        # drafts whose q is not finite (rejected in full by the acceptance), read with the rest
        bad_q = () if draft is None else (~torch.isfinite(draft.lse),)
        if plan.device is None:
            acc, toks, failed, extra = runner.read_results(acc, out, failed, extra=bad_q)
            lengths, cu = plan.lengths, plan.cu
        else:
            dev_lengths, survival, K, source, caps = plan.device
            acc, toks, failed, extra = runner.read_results(acc, out, failed,
                                                           extra=(dev_lengths, survival) + bad_q)
            lengths = extra[:, 0].long().tolist()
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n + 1)
            S = 1 + survival.reshape(len(lengths), -1).shape[1]  # columns: length, survivals
            policy.observe(extra[:, 1:S].float(), torch.tensor(caps), lengths, K, source)
            extra = extra[:, S:]
        conf = draft.conf_logit if draft is not None else None
        res = RoundResult(acc, toks, failed, lengths, raw, cu, conf)
        if draft is not None:  # the row of a rejection (a < l) whose q was not finite
            res.nonfinite = [a < n and bool(row[a] > 0) for a, n, row in zip(acc, lengths, extra.tolist())]
        return res

    def sample(self, runner, draft: Draft | None, plan: Verify, logits, rng):
        """ops.rejection_sample over the verify rows: (accepted [R] int32, out [R, gamma + 1])."""
        if draft is None:
            return ops.rejection_sample(logits, plan.meta.cu_q, None, None, None, **rng)
        return ops.rejection_sample(logits, plan.meta.cu_q, draft.tokens, draft.z, draft.lse, **rng)

    # 7. drafter context --------------------------------------------------------------------------

    def commit_context(self, runner: Runner, batch: SeqBatch, res: RoundResult, feats,
                       drafted: list[bool], lost: list[bool], defers: bool) -> list[bool]:
        """Target features of the anchor and the accepted drafts (positions kv_len .. kv_len + a)
        into the drafter's context, for every request that did not fail; kept instead (deferred)
        for a request that drafted nothing this round when the policy defers, or whose context
        is deferred already. A request that stops inside them gets them too: it frees its pages
        right after, unread. Returns, per request, whether its context is written."""
        R = len(batch)
        if runner.drafter is None:
            return [True] * R
        ids, deferred = batch.ids, self.deferred
        ok, keep = [], []  # one pass: every round runs it for every request
        for i, f in enumerate(res.failed):
            if f or lost[i]:
                continue
            if ids is not None and not drafted[i] and (defers or ids[i] in deferred):
                keep.append(i)
            else:
                ok.append(i)
        if ok:
            runner.context_update([batch.drafter_pages[i] for i in ok], [batch.kv_lens[i] for i in ok],
                                  [res.num_accepted[i] + 1 for i in ok], feats,
                                  [res.cu_rows[i] for i in ok])
        full = []
        for i in keep:
            held, row, a = deferred.setdefault(ids[i], []), res.cu_rows[i], res.num_accepted[i]
            held.extend([(feats, row + k) for k in range(a + 1)])
            if len(held) >= self.max_deferred:
                full.append(i)
        if full:
            self.write_deferred(runner, batch, full)
        written = [False] * R
        for i in ok + full:
            written[i] = True
        return written


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


def first_token(runner: Runner, batch: SeqBatch, logits: torch.Tensor):
    """Round 0: the token after the prompt from the last prefill position's logits [R, V].
    Returns (raw logits, emitted tokens per request, failed per request)."""
    R = len(batch)
    cu = list(range(R + 1))
    raw = logits
    if any(batch.filtered):
        raw = logits.clone() if any(p.logprobs for p in batch.params) else logits
        logits = runner.filter(batch, logits, cu)
    acc, out, failed = ops.rejection_sample(logits, runner.upload(cu, torch.int32), None, None,
                                            None, **runner.rng(batch))
    _, toks, failed, _ = runner.read_results(acc, out, failed)
    return raw, toks, failed

