"""One DSpark round for a batch of decoding requests (DESIGN §2), and round 0 after a prefill.

    decision = policy.decide(view)          0.   before the round (the engine): who drafts
    draft    = runner.draft(...)            1-3. block forward, LM head, sequential + confidence head
    lengths  = policy.lengths(conf)         4.   how many drafts each request verifies
    logits   = runner.verify(chains)        5.   one ragged causal target forward
    masks    = constraints.verify_masks(..)  5b.  grammar rows: state after the drafts before each
    accepted = rejection_sample(...)        6.   lossless acceptance, one host read
    state.commit(committed)                 7.   drafter context of anchor + accepted drafts

Every step is a method, so a benchmark can replace one (dspark_rt/testing: synthetic acceptance,
phase timers) without a hook in the serving path. The round reads the device once (its results),
twice when the decision reads the confidences on the host (threshold, sync, auto); a budget
decision (async) admits on the device and keeps the lengths there until the one read. The
policy's lengths go through runner.decided: under tensor parallelism the leader's are used on
every rank. What lives across rounds (deferred drafter context) is the RoundState's
(runner/state.py); the round itself keeps nothing. Grammar matchers (structured output) live
in the RoundState too (state.constraints), keyed by request id.
"""
from dataclasses import dataclass

import time

import torch

from .. import ops
from ..ops import reference
from ..policies import Calibration, Decision, VerifyPolicy, device_lengths
from ..batch import SeqBatch
from .runner import Draft, Runner
from .state import RoundState


@dataclass
class RoundResult:
    """What one round produced, per request, on the host (one copy); logits stay on the device
    (logprobs read them). Every field is set by the round: none has a default."""
    decision: Decision
    ids: list | None             # the batch's request ids
    num_accepted: list[int]
    out_tokens: list[list[int]]  # x_1 .. x_a, y (the emitted tokens)
    failed: list[bool]           # NaN or +inf in one of the request's target rows
    lengths: list[int]           # drafts verified
    logits: torch.Tensor         # [N, V] target logits of the verify forward, raw (before
                                 # top-k / top-p filtering)
    cu_rows: list[int]           # [R + 1] rows of each request in logits
    conf_logit: torch.Tensor | None  # [R, gamma] raw confidence logits (dspark with a head)
    survival: torch.Tensor | None    # [R, gamma] calibrated survivals on the host, when read
    nonfinite: list[bool]        # rejected at a draft whose q was NaN / inf (a drafter overflow)
    context: list[bool]          # drafter context written up to the committed positions (else
                                 # deferred: the RoundState holds the features)


@dataclass
class Verify:
    """Step 4's lengths, and step 5's batch: ids, positions and metadata of the flat chains.
    On the device path the lengths are a device tensor until the round's read."""
    ids: torch.Tensor
    positions: torch.Tensor
    meta: object
    lengths: list[int] | None        # host path
    cu: list[int] | None             # host path: rows of request r are cu[r] .. cu[r+1]-1
    survival: torch.Tensor | None    # host path: the calibrated survivals read, or None
    device: tuple | None = None      # device path: (lengths [R], survival [R, gamma])
    masks: torch.Tensor | None = None  # step 5b: a grammar's token bitmask of the rows


@dataclass
class Accepted:
    """Step 6 on the host: what the round's one read brought back."""
    num_accepted: list[int]
    out_tokens: list[list[int]]
    failed: list[bool]
    lengths: list[int]
    cu_rows: list[int]
    survival: torch.Tensor | None
    nonfinite: list[bool]


class Round:
    """The round as a callable: Round()(runner, batch, decision, policy, calibration, state) ->
    RoundResult. policy is None on a tensor-parallel worker (the leader's lengths arrive through
    runner.decided); state None: a state of its own for this round (nothing deferred)."""

    def __call__(self, runner: Runner, batch: SeqBatch, decision: Decision,
                 policy: VerifyPolicy | None, calibration: Calibration,
                 state: RoundState | None = None) -> RoundResult:
        state = state if state is not None else RoundState()
        rng = runner.rng(batch)  # Philox keys, one upload: the head and the acceptance read them
        caps = list(decision.caps)
        # 1-3. block [x0, m, .., m] -> h_k, U_k = lm_head(h_k); x_k ~ q_k = softmax((U_k +
        #      bias(x_{k-1}, h_k)) / T), k = 1..gamma; confidence logits c_k. None: a plain
        #      round (the decision drafts for no request)
        draft = None
        # 0b. a grammar's matchers at the committed prefixes (None: no request has a grammar)
        grammar = state.constraints.of(batch, runner.target.config.vocab_size)
        if decision.drafts:
            batch = self.catch_up(runner, batch, caps, state)  # deferred context of those that draft
            draft = self.draft(runner, batch, self.draft_keys(runner, grammar, rng, state.constraints), caps)
        # 4. l_r from the calibrated survivals a_k = prod c_hat_i (never from the tokens: that
        #    keeps it lossless), then the flat chains [x0, x_1 .. x_l] of every request
        plan = self.schedule(runner, batch, draft, decision, policy, calibration)
        # 5. one ragged causal target forward over all chains: P_0 .. P_l, and the features
        logits, feats = self.verify(runner, plan)
        # 5b. a grammar's P' = P * mask / Z: row k masked with the state after the committed
        #    prefix and x_1 .. x_k (the walk stops at the first draft it refuses: P' = 0 there)
        plan.masks = self.constrain(runner, batch, draft, plan, grammar, state.constraints)
        # 6. accept x_k w.p. min(1, P'_{k-1}(x_k) / q_k(x_k)); emit y from the residual
        #    max(0, P' - q) at the first rejection, else the bonus y ~ P'_l; one host read
        raw, acc = self.accept(runner, batch, draft, plan, logits, rng)
        if grammar is not None:  # the matchers advance by the emitted tokens x_1 .. x_a, y
            state.constraints.commit(batch.ids, grammar, acc.out_tokens, acc.num_accepted, acc.failed)
        # 7. drafter context of the committed positions: the anchor and the accepted drafts
        #    (a request that drafted nothing, when the state defers: kept for later)
        drafted = [draft is not None and c > 0 for c in caps]
        context = self.commit_context(runner, batch, acc, feats, drafted, state)
        return RoundResult(decision, batch.ids, acc.num_accepted, acc.out_tokens, acc.failed,
                           acc.lengths, raw, acc.cu_rows,
                           draft.conf_logit if draft is not None else None, acc.survival,
                           acc.nonfinite, context)

    # 0 / 7. deferred drafter context (the state's) -------------------------------------------

    def catch_up(self, runner: Runner, batch: SeqBatch, caps: list[int], state: RoundState) -> SeqBatch:
        return state.catch_up(runner, batch, caps)

    def commit_context(self, runner: Runner, batch: SeqBatch, acc: Accepted, feats,
                       drafted: list[bool], state: RoundState) -> list[bool]:
        return state.commit(runner, batch, acc.num_accepted, acc.failed, acc.cu_rows, feats, drafted)

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

    def schedule(self, runner, batch, draft: Draft | None, decision: Decision, policy,
                 calibration) -> Verify:
        """l_r in [0, caps_r] from the calibrated confidences alone (never the draft tokens:
        that keeps acceptance lossless), and the flat chains [x0, x_1 .. x_l]."""
        R, gamma, caps = len(batch), runner.gamma, list(decision.caps)
        if draft is None:  # plain decoding: the chain is the anchor
            meta, pos, cu = runner.meta(batch.target_pages, batch.kv_lens, [1] * R, True)
            return Verify(runner.upload(batch.anchors, torch.int64), pos, meta, [0] * R, cu, None)
        chains = torch.cat([draft.anchor[:, None], draft.tokens], 1)  # [R, gamma + 1]
        conf = self.confidences(draft)
        c_hat = survival = None
        if not decision.reads_confidence:
            lengths = caps  # every draft the caps allow, confidences unread
        elif decision.budget is not None and conf is not None and not any(batch.filtered):
            _, survival = calibration.apply(conf)  # the top-K admitted on the device
            lengths = device_lengths(survival, runner.upload(caps, torch.int64), gamma, decision.budget)
            n_rows = R + min(decision.budget, sum(caps))  # the verify size, known on the host
            meta, pos, ids = runner.meta_on_device(batch, lengths, n_rows, chains)
            return Verify(ids, pos, meta, None, None, None, (lengths, survival))
        else:
            if conf is not None:
                c_hat, survival = calibration.apply(runner.to_host(conf))
            cap = torch.tensor(caps, dtype=torch.int64)
            lengths = runner.decided(lambda: policy.lengths(decision, c_hat, survival, cap), cap).tolist()
        # the chains are gathered on the device: drafts never visit the host
        pick = [i * (gamma + 1) + k for i, n in enumerate(lengths) for k in range(n + 1)]
        ids = chains.view(-1)[runner.upload(pick, torch.int64)]
        meta, pos, cu = runner.meta(batch.target_pages, batch.kv_lens, [n + 1 for n in lengths], True)
        return Verify(ids, pos, meta, lengths, cu, survival)

    def confidences(self, draft: Draft) -> torch.Tensor | None:
        """The raw confidence logits [R, gamma] the policy sees."""
        return draft.conf_logit

    # 5. verify forward -------------------------------------------------------------------------

    def verify(self, runner: Runner, plan: Verify):
        return runner.verify(plan.ids, plan.positions, plan.meta)

    # 5b. grammar masks -------------------------------------------------------------------------

    def draft_keys(self, runner, grammar, rng: dict, c) -> dict:
        """The head's keyword arguments: the random keys, and under a grammar the committed
        state's mask of draft position 1 (q_1 is then the masked proposal; the CUDA-graph path
        drafts unmasked, lossless too: acceptance uses the q the draft was sampled from)."""
        if grammar is None or runner.graphs is not None:
            return rng
        t0 = time.perf_counter()
        mask = c.first_masks(grammar, runner.target.config.vocab_size, rng["seed"].device)
        c.host_s += time.perf_counter() - t0
        return {**rng, "token_bitmask": mask}

    def constrain(self, runner, batch, draft: Draft | None, plan: Verify, grammar, c):
        """The token bitmask [N, words] of the verify rows under a grammar, else None. Reads the
        drafts (and device-path lengths) to the host: the matchers walk them there."""
        if grammar is None:
            return None
        t0 = time.perf_counter()
        V = runner.target.config.vocab_size
        lengths = plan.lengths
        if lengths is None:  # device path: its lengths come to the host for the walk
            lengths = runner.to_host(plan.device[0]).long().tolist()
        drafts = [[]] * len(batch) if draft is None else runner.to_host(draft.tokens).tolist()
        masks = c.verify_masks(grammar, drafts, lengths, V, plan.ids.device)
        c.host_s += time.perf_counter() - t0
        return masks

    # 6. acceptance -----------------------------------------------------------------------------

    def accept(self, runner, batch, draft, plan: Verify, logits, rng):
        """Accept x_k with probability min(1, P(x_k) / q(x_k)), emit the residual (or bonus)
        token y; then the round's one host read: accepted counts, tokens, failures (and, on the
        device path, the lengths and survivals). Returns (raw logits, Accepted)."""
        raw = logits
        if plan.device is None and any(batch.filtered):
            if any(batch.sampling.logprobs):
                raw = logits.clone()  # logprobs are the target's raw log-probabilities
            logits = runner.filter(batch, premask(logits, plan.masks), plan.cu, plan.ids)
        acc, out, failed = self.sample(runner, draft, plan, logits, rng)
        # drafts whose q is not finite (rejected in full by the acceptance), read with the rest
        bad_q = () if draft is None else (~torch.isfinite(draft.lse),)
        survival = plan.survival
        if plan.device is None:
            acc, toks, failed, extra = runner.read_results(acc, out, failed, extra=bad_q)
            lengths, cu = plan.lengths, plan.cu
        else:
            dev_lengths, dev_survival = plan.device
            acc, toks, failed, extra = runner.read_results(acc, out, failed,
                                                           extra=(dev_lengths, dev_survival) + bad_q)
            lengths = extra[:, 0].long().tolist()
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n + 1)
            S = 1 + dev_survival.reshape(len(lengths), -1).shape[1]  # columns: length, survivals
            survival, extra = extra[:, 1:S].float(), extra[:, S:]
        nonfinite = [False] * len(acc)
        if draft is not None:  # the row of a rejection (a < l) whose q was not finite
            nonfinite = [a < n and bool(row[a] > 0) for a, n, row in zip(acc, lengths, extra.tolist())]
        return raw, Accepted(acc, toks, failed, lengths, cu, survival, nonfinite)

    def sample(self, runner, draft: Draft | None, plan: Verify, logits, rng):
        """ops.rejection_sample over the verify rows: (accepted [R] int32, out [R, gamma + 1]),
        under plan.masks, the grammar's token bitmask of the rows (None: no grammar)."""
        masks = plan.masks
        if masks is not None and masks.shape[0] < logits.shape[0]:  # padding rows: no mask
            pad = masks.new_full((logits.shape[0] - masks.shape[0], masks.shape[1]), -1)
            masks = torch.cat([masks, pad])
        if draft is None:
            return ops.rejection_sample(logits, plan.meta.cu_q, None, None, None,
                                        token_bitmask=masks, **rng)
        return ops.rejection_sample(logits, plan.meta.cu_q, draft.tokens, draft.z, draft.lse,
                                    token_bitmask=masks, **rng)


def premask(logits: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
    """Under a grammar, its mask written into the rows (in place) before top-k / top-p filter
    them: the nucleus is that of P' = P * mask / Z, the grammar's distribution (vLLM's order),
    never one the mask may then empty. Unfiltered rows get their mask inside rejection_sample."""
    if masks is not None:
        n = masks.shape[0]
        logits[:n].masked_fill_(~reference.allowed(masks, logits.shape[1]), float("-inf"))
    return logits


def first_token(runner: Runner, batch: SeqBatch, logits: torch.Tensor,
                state: RoundState | None = None):
    """Round 0: the token after the prompt from the last prefill position's logits [R, V] (under
    a grammar, the state's matchers mask it). Returns (raw logits, emitted tokens per request,
    failed per request)."""
    state = state if state is not None else RoundState()
    R = len(batch)
    cu = list(range(R + 1))
    raw = logits
    grammar = state.constraints.of(batch, runner.target.config.vocab_size)
    masks = None
    if grammar is not None:  # the first token under the grammar's start state
        masks = state.constraints.first_masks(grammar, runner.target.config.vocab_size, logits.device)
    if any(batch.filtered):
        raw = logits.clone() if any(batch.sampling.logprobs) else logits
        logits = runner.filter(batch, premask(logits, masks), cu)
    acc, out, failed = ops.rejection_sample(logits, runner.upload(cu, torch.int32), None, None,
                                            None, token_bitmask=masks, **runner.rng(batch))
    _, toks, failed, _ = runner.read_results(acc, out, failed)
    if grammar is not None:
        state.constraints.commit(batch.ids, grammar, toks, [0] * R, failed)
    return raw, toks, failed

