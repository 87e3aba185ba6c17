"""policy="auto": per round, a plain round or a speculative one, whichever the machine's profiles
say pays (dspark_rt/policies/auto.py). Greedy output stays plain decoding's while it switches;
the sampled law is checked in tests/test_lossless_sampling.py (case dspark-auto)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.policies import AutoPolicy, BatchView, Decision
from dspark_rt.policies.auto import CLEAR_LOSS, SPEC_GAIN
from dspark_rt.policies.explore import MAX_BACKOFF
from dspark_rt.policies.sps import SPSProfile
from tests.support.shipped_pair import DRAFTERS, PROMPTS, TARGET

SPEC = SPSProfile([2 ** i for i in range(12)], [2 ** (-i / 2) for i in range(12)])
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# plain rounds of B tokens, speculative rounds (R = ceil(B / 8)), and rounds of R requests that
# draft and verify nothing: drafting for many requests costs more than their drafts return
PLAIN = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
SPS = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
DRAFTING = SPSProfile([1, 8, 32], [80.0, 15.0, 5.0])


def view(R=1, ids=None, caps=7, waiting=None, gamma=7) -> BatchView:
    return BatchView(None if ids is None else tuple(ids), (caps,) * R if isinstance(caps, int)
                     else tuple(caps), tuple(waiting or [0] * R), gamma)


def observe(pol, survival, caps, ids=None):
    """A round in which the requests with caps > 0 drafted and their calibrated survivals
    [R, gamma] were read: what the round hands the policy after its host read."""
    survival = torch.as_tensor(survival, dtype=torch.float64)
    pol.observe(SimpleNamespace(decision=Decision(tuple(caps)), ids=ids, survival=survival,
                                lengths=list(caps), num_accepted=[0] * len(caps)))


ALL = Decision((7,) * 8)  # 8 requests that drafted 7 each


def seeded(pol, value, gamma=7):
    """pol with its shared estimate at `value` at every position (one observed round of one
    request without an id: the first update is taken whole)."""
    observe(pol, torch.full((1, gamma), value), [gamma])
    return pol


@pytest.fixture(scope="module")
def plain_tokens():
    ar = Decoder.from_pretrained(TARGET, mode="ar", dtype="float64")
    return [o.token_ids for o in ar.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _run(policy):
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=policy, dtype="float64",
                                  calibration="none")
    return dec.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("plain_speed,expect", [(0.3, "speculative"), (3.0, "plain")])
def test_it_picks_the_faster_round(plain_tokens, plain_speed, expect):
    """Plain rounds 3x slower than a speculative round of the same size: it always drafts;
    3x faster: it decodes plainly, drafting only to keep its estimates fresh."""
    pol = AutoPolicy(SPEC, SPEC.scaled(plain_speed), explore_every=16)
    outs = _run(pol)
    assert [o.token_ids for o in outs] == plain_tokens
    other = "plain" if expect == "speculative" else "speculative"
    assert pol.rounds[expect] > 4 * pol.rounds[other], pol.rounds
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert (drafted > 0) == (expect == "speculative" or pol.rounds["speculative"] > 0)



def _context(dec, out, min_pages=2):
    """The drafter context K of the full pages of a finished request's committed tokens (the
    prefix cache keeps them): a function of the token prefix alone."""
    blocks = dec.engine.drafter_blocks
    tokens = out.prompt_token_ids + out.token_ids[:-1]
    pages = blocks.lookup_prefix(tokens)
    assert len(pages) >= min_pages
    return dec.runner.dcache.k_all[:, pages]


def test_switching_every_round_keeps_greedy_output_and_drafter_context(plain_tokens):
    """Plain rounds defer the drafter context of the positions they commit and the next
    drafting round writes it, so the context after a run that switches every round equals the
    one after drafting every round (on this pair a missing context row costs acceptance too
    little to see in tau)."""
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=2)
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=pol, dtype="float64",
                                  calibration="none")
    outs = dec.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_tokens[:1]
    assert pol.rounds["plain"] >= 3 and pol.rounds["speculative"] >= 3, pol.rounds
    ref = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], dtype="float64")
    ref_outs = ref.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    # float64: forwards of other chain lengths round the features differently, by ~1e-15. The
    # pages of positions still deferred when the request finished hold no context (never paid
    # for) and are not shared: the written pages are compared
    got, want = _context(dec, outs[0]), _context(ref, ref_outs[0])
    n = min(got.shape[1], want.shape[1])
    torch.testing.assert_close(got[:, :n], want[:, :n], rtol=1e-9, atol=1e-9)


def test_when_every_draft_pays_it_verifies_all_unread(plain_tokens):
    """A flat speculative profile (a verified draft costs nothing): the estimates say every draft
    pays, so most rounds verify all of them without reading the confidences (one device read
    per round, as under fixed); one in explore_every still reads them."""
    flat = SPSProfile([1, 4096], [1.0, 1.0])
    pol = AutoPolicy(flat, flat.scaled(0.1), explore_every=4)
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=pol, dtype="float64",
                                  calibration="none")
    outs = dec.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_tokens
    r = pol.rounds
    assert r["plain"] == 0 and r["speculative"] // 2 < r["blind"] < r["speculative"], r
    e = dec.engine
    assert e.round_host_reads == 2 * e.num_rounds - r["blind"]  # a read round reads twice


def test_bad_arguments():
    with pytest.raises(ValueError, match="decay"):
        AutoPolicy(SPEC, SPEC, decay=1.0)
    with pytest.raises(ValueError, match="explore_every"):
        AutoPolicy(SPEC, SPEC, explore_every=-1)
    with pytest.raises(ValueError, match="explore_share"):
        AutoPolicy(SPEC, SPEC, explore_share=0.0)
    with pytest.raises(ValueError, match="explore_budget"):
        AutoPolicy(SPEC, SPEC, explore_budget=0.0)


def test_drafting_cost_of_many_requests_is_counted():
    """With the profile of rounds that draft but verify nothing, a batch whose drafting costs
    more than its drafts can return decodes plainly, although sps(B) alone (measured on fewer
    requests per B) would say drafting pays; a single request still drafts."""
    est = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]])
    naive, costed, single = (AutoPolicy(SPS, PLAIN, d, explore_every=0) for d in (None, DRAFTING, DRAFTING))
    for pol in (naive, costed, single):
        observe(pol, est, [7])
    assert naive.decide(view(8)).drafts and not costed.decide(view(8)).drafts  # 8 x 8 drafting
    assert single.decide(view(1)).drafts  # one request: 1 + 4.2 tokens for ~1.6x


def test_it_drafts_for_the_requests_whose_drafts_pay():
    """Each request has its own estimate once it drafted: in a batch of 8 where drafting for
    all costs more than it returns, the one request whose drafts are nearly all accepted (its
    text repeats) drafts alone; the others decode plainly in the same round. Without request
    ids (one shared estimate) the round is plain; a finished request's estimate is forgotten."""
    ids = list("abcdefgh")
    only_c = [0, 0, 7, 0, 0, 0, 0, 0]
    pol = seeded(AutoPolicy(SPS, PLAIN, DRAFTING, explore_every=0), 0.2)
    pol.explore.tried.update(ids)  # not new: no first-round exploring
    assert not pol.decide(view(8, ids)).drafts  # no request has its own estimate: no
    observe(pol, torch.full((8, 7), 0.99), only_c, ids)  # c drafted once, nearly all accepted
    d = pol.decide(view(8, ids))
    assert d.caps == tuple(only_c) and not d.explore
    # its own survivals, seen in the round, update its estimate (and only its own)
    before = pol.estimates.for_batch(ids, 8, 7)
    observe(pol, torch.full((8, 7), 0.5), only_c, ids)
    after = pol.estimates.for_batch(ids, 8, 7)
    assert after[2, 0] == pytest.approx(0.8 * 0.99 + 0.2 * 0.5)
    assert (after[[0, 1, 3]] != before[[0, 1, 3]]).all()  # the others read the shared one
    assert not pol.decide(view(8)).drafts  # ids unknown: no own estimate to go on
    pol.forget("c")  # it finished
    assert not pol.estimates.knows("c") and "c" not in pol.explore.tried


def test_exploring_rounds_draft_for_a_few_requests(plain_tokens):
    """While plain rounds win, an exploring round drafts for explore_share of the batch only (in
    turn), and the estimates learn from those requests' survivals alone; greedy output stays
    plain decoding's."""
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=2, explore_share=0.25)
    seen, decide = [], pol.decide
    pol.decide = lambda v: seen.append((v.caps, decide(v))) or seen[-1][1]
    outs = _run(pol)
    assert [o.token_ids for o in outs] == plain_tokens
    explored = [(caps, d.caps) for caps, d in seen if len(caps) >= 4 and d.explore and d.drafts]
    assert explored, seen
    for before, after in explored:
        kept = [i for i, c in enumerate(after) if c > 0]
        assert 1 <= len(kept) <= max(1, len(before) // 4)
        assert all(after[i] == before[i] for i in kept)
    starts = {tuple(i for i, c in enumerate(a) if c > 0) for _, a in explored}
    assert len(starts) > 1, "the exploring requests must rotate"


def test_exploring_backs_off_while_plain_rounds_win():
    """Exploring intervals double while plain rounds keep winning clearly (up to MAX_BACKOFF x
    explore_every) and fall back to explore_every after a round that speculates on the
    estimates' word, or while the call is close; the first round, with nothing known, explores
    with a few requests and reads their confidences."""
    # plain rounds 2x a speculative round of the same size: at survival 0.5 plain wins clearly
    # (~0.5x), with every draft surviving speculation wins (~1.4x)
    pol = AutoPolicy(SPEC, SPEC.scaled(2.0), explore_every=4, explore_share=0.125)
    first = pol.decide(view(16))
    assert first.explore and first.reads_confidence and sum(c > 0 for c in first.caps) == 2
    observe(pol, torch.full((16, 7), 0.5), first.caps)

    def gaps(pol, rounds, R=16):
        spec = [i for i in range(rounds) if pol.decide(view(R)).drafts]
        return [b - a for a, b in zip([-1] + spec, spec)]
    assert gaps(pol, 4 + 8 + 16 + 32 + 32 + 32) == [4, 8, 16, 32, 32, 32]
    assert MAX_BACKOFF * 4 == 32
    # the estimates say speculate (every draft survives): a speculative round, and back to 4
    observe(pol, torch.ones(16, 7), (7,) * 16)
    d = pol.decide(view(16))
    assert d.drafts and not d.explore
    for _ in range(40):  # and back to survival 0.5 (each update keeps 0.8 of the old one)
        observe(pol, torch.full((16, 7), 0.5), d.caps)
    assert gaps(pol, 4 + 8) == [4, 8]
    # a close call (speculation expected at CLEAR_LOSS of plain tokens/s or more): no backing off
    close = seeded(AutoPolicy(SPEC, SPEC, explore_every=4), 0.05)  # plain and n = 0 alike
    theta = close.cost.theta(16, 16, np.repeat(np.minimum.accumulate(close.estimates.shared), 16))
    assert CLEAR_LOSS <= close.cost.gain(16, float(theta.max())) <= SPEC_GAIN
    assert gaps(close, 3 * 4) == [4, 4, 4]


def test_estimates_age_by_rounds_and_by_the_share_seen():
    """After 16 plain rounds, one request that drafts alone (batch 1) replaces the estimate
    almost entirely (old weight 0.8^16); one of 8 requests moves it as two rounds would (0.8^2)."""
    from dspark_rt.policies.estimates import SurvivalEstimates
    for R, old_weight in ((1, 0.8 ** 16), (8, 0.8 ** 2)):
        est = SurvivalEstimates(decay=0.8)
        est.update(None, np.ones(1, bool), np.full((1, 7), 0.1), 0)
        for _ in range(16):
            est.tick()
        drafted = np.zeros(R, bool)
        drafted[0] = True
        est.update(None, drafted, np.full((1, 7), 0.9), 16)
        np.testing.assert_allclose(est.shared, old_weight * 0.1 + (1 - old_weight) * 0.9)
    with pytest.raises(ValueError, match="decay"):
        SurvivalEstimates(1.0)


def test_round_cost_reads_the_profiles():
    """Seconds of plain rounds (linear beyond the profile), of drafting (the no-drafts round less
    a plain round of as many), of context, and Algorithm 1's Theta without the drafting profile."""
    from dspark_rt.policies.cost import RoundCost
    sps = SPSProfile.from_pairs({B: 1.0 / B for B in range(1, 17)})
    plain = SPSProfile([1, 8], [100.0, 50.0])
    cost = RoundCost(sps.dense(16), 16, plain, SPSProfile([1, 2], [40.0, 20.0]),
                     SPSProfile([1, 10], [1000.0, 100.0]))
    assert cost.plain_s(8) == pytest.approx(0.02) and cost.plain_s(12) > cost.plain_s(8)
    assert cost.plain_s(12) - cost.plain_s(10) == pytest.approx(cost.plain_s(10) - cost.plain_s(8))
    assert cost.drafting_s(1) == pytest.approx(1 / 40 - 1 / 100) and cost.drafting_s(3) == 0.0
    assert cost.context_s(10) == pytest.approx(0.01) and cost.context_s(20) == pytest.approx(0.02)
    assert cost.explore_s([0], [10]) == pytest.approx(cost.drafting_s(1) + 0.01)
    naive = RoundCost(sps.dense(16), 16, plain)
    a = np.array([0.5, 0.25])
    np.testing.assert_allclose(naive.theta(2, 2, a), [2 * 0.5, 2.5 / 3, 2.75 / 4])


def test_lengths_price_drafting_once():
    """A speculative round's lengths come from Algorithm 1 on auto's own round cost: drafting
    once for the requests that drafted, each verified token at the plain profile's growth. With
    verification free on this machine (flat plain profile) it verifies every draft, where sync,
    whose SPS(B) charges a round per token, verifies none."""
    from dspark_rt.policies.prefix import SyncScheduler
    steep = SPSProfile.from_pairs({B: 1.0 / B for B in range(1, 257)})
    flat = SPSProfile.from_pairs({B: 1.0 for B in range(1, 33)})
    drafting = SPSProfile.from_pairs({R: 0.5 for R in range(1, 33)})
    survival = torch.full((8, 7), 0.9).cumprod(1)
    cap = torch.full((8,), 7)
    auto = AutoPolicy(steep, flat, drafting)
    assert auto.lengths(ALL, None, survival, cap).tolist() == [7] * 8
    assert SyncScheduler(steep).lengths(ALL, None, survival, cap).tolist() == [0] * 8
    # costly verification (each token a full round): auto stops early, as Algorithm 1 does
    auto = AutoPolicy(steep, SPSProfile.from_pairs({B: 1.0 / B for B in range(1, 33)}), drafting)
    assert auto.lengths(ALL, None, survival, cap).sum() < 8


def test_a_step_in_the_measured_curve_does_not_stop_admission():
    """A round's verify cost grows along the chord of the plain profile: a step in the measured
    curve (a tile boundary at B = 10) does not make Algorithm 1 stop before the drafts that
    pay for it."""
    steep = SPSProfile.from_pairs({B: 1.0 / B for B in range(1, 257)})
    stepped = SPSProfile.from_pairs({B: 1.0 / (1.0 + 0.01 * B + (0.5 if B >= 10 else 0.0))
                                     for B in range(1, 65)})
    drafting = SPSProfile.from_pairs({R: 0.4 for R in range(1, 33)})
    survival = torch.full((8, 7), 0.97).cumprod(1)
    lengths = AutoPolicy(steep, stepped, drafting).lengths(ALL, None, survival, torch.full((8,), 7))
    assert lengths.tolist() == [7] * 8


@pytest.mark.parametrize("max_deferred", [None, 2])
def test_deferred_context_is_written_before_a_request_drafts(plain_tokens, max_deferred):
    """Long plain stretches (exploring with half the batch in turn): the round state keeps the
    features of the positions plain rounds commit and the round writes their drafter context
    when the request drafts again, or when max_deferred positions wait. The context the prefix
    cache keeps equals that of drafting every round, as do the greedy tokens; pages whose
    context is still deferred are never shared."""
    from dspark_rt.runner.state import RoundState
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=2, explore_share=0.5)
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=pol, dtype="float64",
                                  calibration="none")
    if max_deferred is not None:
        dec.engine.state.max_deferred = max_deferred
    written, waiting = [], []
    commit = dec.engine.round.commit_context
    dec.engine.round.commit_context = lambda *a: written.append(commit(*a)) or written[-1]
    decide = pol.decide
    pol.decide = lambda v: waiting.append(v.waiting) or decide(v)
    outs = dec.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_tokens[:4]
    deferred = sum(not w for ws in written for w in ws)
    assert deferred > 20 and pol.rounds["speculative"] >= 3, (deferred, pol.rounds)
    # the policy is told, per request, how many positions wait for their context (it prices
    # exploring with them): none before the first plain round, never max_deferred or more
    most = max(max(w) for w in waiting)
    assert waiting[0] == (0,) * 4 and 1 <= most < (max_deferred or RoundState.max_deferred), most
    assert not dec.engine.state.deferred and not dec.engine.state.live  # finished: nothing held
    ref = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], dtype="float64")
    ref_outs = ref.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    shared = 0
    for out, ref_out in zip(outs, ref_outs):
        # a request that finished with context still deferred shares fewer pages
        got, want = _context(dec, out, min_pages=1), _context(ref, ref_out)
        shared += got.shape[1]
        n = min(got.shape[1], want.shape[1])
        torch.testing.assert_close(got[:, :n], want[:, :n], rtol=1e-9, atol=1e-9)
    assert shared > len(outs), shared  # some request shares two pages or more


def test_round_state_has_one_owner():
    """The state holds what the engine told it: a request it was never told of, or deferred rows
    that do not cover ctx_len .. kv_len exactly, is an error (never a silent rebuild); finish and
    abort drop everything of a request and tell the policy, preemption drops the features."""
    from dspark_rt.batch import SamplingBatch, SeqBatch
    from dspark_rt.runner.state import RoundState
    forgotten = []
    policy = SimpleNamespace(forget=forgotten.append)
    state = RoundState(policy, defers=True)
    f = torch.zeros(4, 3)
    for rid in "ab":
        state.add(rid)
    state.deferred = {"a": [(f, 0), (f, 1)], "b": [(f, 2)]}
    batch = lambda kv, ctx, ids: SeqBatch(kv, ctx, [[0]] * len(kv), [[0]] * len(kv), [1] * len(kv),
                                          [7] * len(kv), SamplingBatch.of([GREEDY] * len(kv)), [0] * len(kv),
                                          [1] * len(kv), [1] * len(kv), ids=ids)
    assert state.view(batch([10, 7], [8, 6], ["a", "b"]), 7).waiting == (2, 1)
    with pytest.raises(RuntimeError, match="holds 1"):
        state.view(batch([10, 7], [8, 5], ["a", "b"]), 7)
    with pytest.raises(RuntimeError, match="never added"):
        state.view(batch([5], [5], ["c"]), 7)
    state.preempt("b")
    assert "b" not in state.deferred and "b" in state.live and not forgotten
    state.finish("a")
    assert not state.deferred and forgotten == ["a"] and state.live == {"b"}


def test_preempted_requests_under_auto_keep_their_tokens(plain_tokens):
    """A pool too small for the batch preempts requests while plain rounds defer their drafter
    context: the engine tells the state, which drops what it held for them; they are recomputed
    from their tokens, and greedy output stays plain decoding's."""
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=4, explore_share=0.5)
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=pol, dtype="float64",
                                  calibration="none", page_size=4)
    eng = dec.new_engine(num_pages=40, max_num_seqs=4)
    held, preempt = [], eng.state.preempt
    eng.state.preempt = lambda rid: held.append(len(eng.state.deferred.get(rid, ()))) or preempt(rid)
    reqs = [eng.requests[eng.add_request(p, GREEDY)] for p in PROMPTS[:4]]
    while eng.has_unfinished():
        eng.step()
    assert [eng.output(r).token_ids for r in reqs] == plain_tokens[:4]
    assert eng.scheduler.num_preemptions == len(held) > 0 and max(held) > 0, held
    assert not eng.state.deferred and not eng.state.live


def test_a_decision_is_reused_only_while_its_inputs_stand(plain_tokens):
    """A plain stretch reuses the last pricing while the estimates and the batch are unchanged;
    over a whole run (explorations, per-request estimates, requests finishing) every round
    decides exactly as a policy that prices every round afresh."""
    class Afresh(AutoPolicy):
        def decide(self, view):
            self._last = None
            return super().decide(view)

    logs = []
    for cls in (AutoPolicy, Afresh):
        # profiles under which the estimates flip the decision during the run
        pol = cls(SPEC, SPEC.scaled(1.3), SPEC.scaled(0.9), explore_every=3, explore_share=0.25)
        log, decide = [], pol.decide
        pol.decide = lambda v: log.append((v.caps, decide(v))) or log[-1][1]
        assert [o.token_ids for o in _run(pol)] == plain_tokens
        logs.append((log, dict(pol.rounds)))
    assert logs[0] == logs[1]
    assert {d.drafts for _, d in logs[1][0]} == {True, False}, logs[1][1]


def test_a_new_request_is_explored_when_its_drafts_could_pay():
    """The shared estimate says drafts rarely survive (other requests' text), and plain rounds
    have backed exploring off: a request that joins alone still drafts in its first round,
    because a speculative round of its drafts would pay clearly if they survived; its own
    survivals then decide. In a batch of 32 where even that best case loses, new requests decode
    plainly. A request is explored this way once."""
    def backed_off():
        pol = seeded(AutoPolicy(SPS, PLAIN, DRAFTING, explore_every=16), 0.05)
        pol.explore.interval = 128
        return pol
    pol = backed_off()
    pol.explore.tried.add("old")
    assert not pol.decide(view(1, ["old"])).drafts  # explored before: the estimate decides
    d = pol.decide(view(1, ["new"]))
    assert d.drafts and d.explore and d.reads_confidence and d.caps == (7,)
    observe(pol, torch.full((1, 7), 0.95), d.caps, ["new"])
    assert pol.decide(view(1, ["new"])).drafts  # on its own estimate now
    assert not backed_off().decide(view(32, [f"r{i}" for i in range(32)])).drafts
    pol = backed_off()
    d = pol.decide(view(2, "ab"))
    assert d.drafts and d.caps == (7, 0)  # one at a time
    observe(pol, torch.full((2, 7), 0.01), d.caps, list("ab"))
    d = pol.decide(view(2, "ab"))
    assert d.drafts and d.caps == (0, 7)
    observe(pol, torch.full((2, 7), 0.01), d.caps, list("ab"))
    assert not pol.decide(view(2, "ab")).drafts  # both tried, both poor: plain
    pol.forget("a")
    assert "a" not in pol.explore.tried


@pytest.mark.parametrize("drafting_speed,budget_binds", [(50.0, True), (99.5, False)])
def test_exploring_spends_at_most_its_budget(drafting_speed, budget_binds):
    """Plain rounds win (no draft is expected to survive) and exploring is forced every 2
    rounds (backing off to 16 while the loss is clear). Where drafting one request costs a
    whole plain round (a CPU), exploring spends at most explore_budget of the plain rounds' time
    (plus the two rounds the credit starts with); where it costs a two-hundredth of one, the
    interval alone decides, as without a budget."""
    drafting = SPSProfile([1, 8, 32], [drafting_speed, 15.0, 5.0])
    cost = 1 / drafting_speed - 1 / 100.0  # seconds the drafting of one request adds
    counts = {}
    for budget in (0.02, 1.0):
        pol = seeded(AutoPolicy(SPS, PLAIN, drafting, explore_every=2, explore_budget=budget), 0.0)
        pol.explore.tried.add("a")
        counts[budget] = sum(pol.decide(view(1, ["a"])).drafts for _ in range(2000))
        assert pol.rounds["speculative"] == counts[budget]
    unbounded = counts[1.0]
    assert unbounded >= 2000 // (MAX_BACKOFF * 2)  # the interval alone: about one in 16
    if budget_binds:
        assert counts[0.02] * cost <= 0.02 * 2000 * 0.01 + 2 * cost
        assert counts[0.02] < unbounded / 2
    else:
        assert counts[0.02] == unbounded


def test_exploring_prices_the_context_it_writes_first():
    """A request that decoded plainly for a while writes the drafter context of those positions
    before it drafts. With the context profile, exploring a request with 100 such positions
    costs (here) about a plain round more, so within the same budget it explores less often than
    a request with none waiting, and exploring spends at most its budget counting that cost."""
    drafting = SPSProfile([1, 8, 32], [99.5, 15.0, 5.0])   # drafting one request: 0.05 ms
    context = SPSProfile([1, 64, 128], [2000.0, 200.0, 100.0])  # 128 positions: 10 ms
    counts, costs = {}, {}
    for waiting in (0, 100):
        pol = seeded(AutoPolicy(SPS, PLAIN, drafting, context, explore_every=2), 0.0)
        pol.explore.tried.add("a")
        counts[waiting] = sum(pol.decide(view(1, ["a"], waiting=[waiting])).drafts for _ in range(2000))
        costs[waiting] = pol.cost.explore_s([0], [waiting])
    assert costs[100] > 10 * costs[0]
    assert counts[0] == 1000  # every second round: the interval alone
    assert counts[100] < counts[0] / 4
    assert counts[100] * costs[100] <= 0.02 * 2000 * 0.01 + 2 * costs[100]


def test_the_credit_prices_the_rows_that_draft_and_holds_two_rounds():
    """The credit is spent on the rows an exploring round drafts for (the rotation's, with their
    own deferred context), holds at most two exploring rounds whatever the stretch before it,
    and is not spent while no row may draft (requests that opted out of speculation)."""
    drafting = SPSProfile([1, 8, 32], [50.0, 15.0, 5.0])
    context = SPSProfile([1, 64, 128], [2000.0, 200.0, 100.0])
    ids = list("abcdefgh")
    # R = 8, explore_share 1/4: the rotation drafts for rows 6 and 7 next; it is charged their
    # drafting and their 150 deferred positions, not anyone else's
    pol = seeded(AutoPolicy(SPS, PLAIN, drafting, context, explore_every=1, explore_share=0.25), 0.0)
    pol.explore.tried.update(ids)
    pol.explore.next_row = 6
    waiting = [0, 0, 0, 0, 0, 0, 50, 100]
    pol.explore.credit = 10.0  # plenty; the cap cuts it to two rounds of these rows
    want = pol.cost.explore_s([6, 7], waiting)
    assert want > pol.cost.explore_s([0, 1], waiting) > 0
    assert pol.decide(view(8, ids, waiting=waiting)).caps == (0,) * 6 + (7, 7)
    assert pol.explore.credit == pytest.approx(want, rel=1e-6)  # two rounds of these, one spent
    # a long speculative stretch (the estimates say every draft pays) banks no more than two
    # exploring rounds: once plain rounds win, exploring every round is cut to the budget
    pol = seeded(AutoPolicy(SPS, PLAIN, drafting, explore_every=1), 0.95)
    pol.explore.tried.add("a")
    for _ in range(500):
        d = pol.decide(view(1, ["a"]))
        assert d.drafts and not d.explore
    observe(pol, torch.zeros(1, 7), (7,))  # a clear loss from now on (0.2 x 0.95 left)
    explored = sum(pol.decide(view(1, ["a"])).drafts for _ in range(20))
    assert 1 <= explored <= 2  # 20 plain rounds add 0.4 of one exploring round's 10 ms
    # while no request may draft (speculative=False), nothing is spent: exploring resumes at
    # once when one may
    pol = AutoPolicy(SPS, PLAIN, drafting, explore_every=2)
    for _ in range(1000):
        pol.decide(view(1, caps=0))
    assert pol.explore.credit is None  # nothing priced or spent: it starts full when one may draft
    seeded(pol, 0.0)
    assert any(pol.decide(view(1)).drafts for _ in range(3))


def test_it_speculates_only_on_a_clear_expected_gain():
    """The profiles leave out the host scheduling of a speculative round, so a round speculates
    on the estimates' word only when they expect SPEC_GAIN over a plain round: an expected 1.05x
    decodes plainly, 1.2x drafts."""
    seen = []
    for c in np.linspace(0.05, 0.99, 95):
        pol = seeded(AutoPolicy(SPS, PLAIN, SPSProfile([1, 8, 32], [50.0, 15.0, 5.0]),
                                explore_every=0), c)
        a = np.minimum.accumulate(pol.estimates.shared)
        margin = pol.cost.gain(1, float(pol.cost.theta(1, 1, a).max()))
        spec = pol.decide(view(1)).drafts
        seen.append((margin, spec))
        assert spec == (margin > SPEC_GAIN), (c, margin)
    assert any(1.0 < m <= SPEC_GAIN for m, _ in seen) and any(s for _, s in seen)
