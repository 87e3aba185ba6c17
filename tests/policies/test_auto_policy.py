"""policy="auto": per round, a plain round or a speculative one, whichever the machine's profiles
say pays (dspark_rt/policies/auto.py). Greedy output stays plain decoding's while it switches;
the sampled law is checked in tests/test_lossless_sampling.py (case dspark-auto)."""
import numpy as np
import pytest
import torch

from dspark_rt import Decoder, SamplingParams
from dspark_rt.policies import AutoPolicy
from dspark_rt.policies.sps import SPSProfile
from tests.support.shipped_pair import DRAFTERS, PROMPTS, TARGET

SPEC = SPSProfile([2 ** i for i in range(12)], [2 ** (-i / 2) for i in range(12)])
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


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


def test_drafting_cost_of_many_requests_is_counted():
    """With the profile of rounds that draft but verify nothing, a batch whose drafting costs
    more than its drafts can return decodes plainly, although sps(B) alone (measured on fewer
    requests per B) would say drafting pays; a single request still drafts."""
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])      # plain rounds of B tokens
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])         # R = ceil(B / 8) requests
    drafting = SPSProfile([1, 8, 32], [80.0, 15.0, 5.0])               # R requests, no drafts
    estimate = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    decide = lambda pol, R: pol._decide([7] * R, 7)[0]
    naive, costed = AutoPolicy(sps, plain), AutoPolicy(sps, plain, drafting)
    for pol in (naive, costed):
        pol.estimate = np.array(estimate)
    assert decide(naive, 8) and not decide(costed, 8)   # 8 x 8 tokens of drafting does not pay
    assert decide(costed, 1)                             # one request: 1 + 4.2 tokens for ~1.6x


def test_it_drafts_for_the_requests_whose_drafts_pay():
    """Each request has its own estimate once it drafted: in a batch of 8 where drafting for
    all costs more than it returns, the one request whose drafts are nearly all accepted (its
    text repeats) drafts alone; the others decode plainly in the same round. Without request
    ids (one shared estimate) the round is plain."""
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
    drafting = SPSProfile([1, 8, 32], [80.0, 15.0, 5.0])
    ids = list("abcdefgh")
    pol = AutoPolicy(sps, plain, drafting, explore_every=0)
    pol.estimate = np.full(7, 0.2)
    assert not pol.speculates([7] * 8, 7)  # ids unknown to it: the shared estimate says no
    pol._own["c"] = (np.full(7, 0.99), pol._round)
    pol.begin_round(ids)
    assert pol.speculates([7] * 8, 7)
    assert pol.draft_caps([7] * 8) == [0, 0, 7, 0, 0, 0, 0, 0]
    # its own survivals, seen in the round, update its estimate (and only its own)
    pol.lengths(None, torch.full((8, 7), 0.5), torch.tensor([0, 0, 7, 0, 0, 0, 0, 0]), 7)
    assert set(pol._own) == {"c"} and pol._own["c"][0][0] == pytest.approx(0.8 * 0.99 + 0.2 * 0.5)
    pol.begin_round(None)
    assert not pol.speculates([7] * 8, 7)  # ids unknown to it: no own estimate to go on


def test_exploring_rounds_draft_for_a_few_requests(plain_tokens):
    """While plain rounds win, an exploring round drafts for explore_share of the batch only (in
    turn), and the estimates learn from those requests' survivals alone; greedy output stays
    plain decoding's."""
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=2, explore_share=0.25)
    seen = []
    draft_caps = pol.draft_caps
    pol.draft_caps = lambda caps: seen.append((caps, draft_caps(caps))) or seen[-1][1]
    outs = _run(pol)
    assert [o.token_ids for o in outs] == plain_tokens
    explored = [(before, after) for before, after in seen if len(before) >= 4 and after != before]
    assert explored, seen
    for before, after in explored:
        kept = [i for i, c in enumerate(after) if c > 0]
        assert 1 <= len(kept) <= max(1, len(before) // 4)
        assert all(after[i] == before[i] for i in kept)
    starts = {tuple(i for i, c in enumerate(a) if c > 0) for _, a in explored}
    assert len(starts) > 1, "the exploring requests must rotate"
    with pytest.raises(ValueError, match="explore_share"):
        AutoPolicy(SPEC, SPEC, explore_share=0.0)


def test_exploring_backs_off_while_plain_rounds_win():
    """Exploring intervals double while plain rounds keep winning (up to MAX_BACKOFF x
    explore_every) and fall back to explore_every after a round that speculates on the
    estimates' word; the first round, with nothing known, explores with a few requests and
    reads their confidences."""
    from dspark_rt.policies.auto import MAX_BACKOFF
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=4, explore_share=0.125)
    caps = [7] * 16
    assert pol.speculates(caps, 7) and pol.needs_confidence
    assert sum(c > 0 for c in pol.draft_caps(caps)) == 2
    pol.estimate = np.full(7, 0.5)

    def gaps(rounds):
        spec = [i for i in range(rounds) if pol.speculates(caps, 7)]
        return [b - a for a, b in zip([-1] + spec, spec)]
    assert gaps(4 + 8 + 16 + 32 + 32 + 32) == [4, 8, 16, 32, 32, 32]
    assert MAX_BACKOFF * 4 == 32
    decide = pol._decide
    pol._decide = lambda c, g: (True, False)  # the estimates say speculate: back to the start
    assert pol.speculates(caps, 7)
    pol._decide = decide
    assert gaps(4 + 8) == [4, 8]
    # a close call (speculation expected at 0.95 of plain tokens/s): no backing off; at 0.8
    # (a clear loss) it backs off
    pol._decide = lambda c, g: (setattr(pol, "_margin", 0.95), (False, False))[1]
    assert gaps(3 * 4) == [4, 4, 4]
    pol._decide = lambda c, g: (setattr(pol, "_margin", 0.8), (False, False))[1]
    assert gaps(8 + 16) == [8, 16]


def test_estimates_age_by_rounds_and_by_the_share_seen():
    """After 16 plain rounds, one request that drafts alone (batch 1) replaces the estimate
    almost entirely (old weight 0.8^16); one of 8 requests moves it as two rounds would (0.8^2)."""
    for R, old_weight in ((1, 0.8 ** 16), (8, 0.8 ** 2)):
        pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=0)
        pol.estimate = np.full(7, 0.1)
        for _ in range(16):
            assert not pol.speculates([7] * R, 7)
        survival = torch.full((R, 7), 0.9)
        cap = torch.tensor([7] + [0] * (R - 1))
        pol.lengths(None, survival, cap, 7)
        want = old_weight * 0.1 + (1 - old_weight) * 0.9
        np.testing.assert_allclose(pol.estimate, want, rtol=1e-6)  # float32 survivals


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
    assert auto.lengths(None, survival, cap, 7).tolist() == [7] * 8
    assert SyncScheduler(steep).lengths(None, survival, cap, 7).tolist() == [0] * 8
    # costly verification (each token a full round): auto stops early, as Algorithm 1 does
    auto = AutoPolicy(steep, SPSProfile.from_pairs({B: 1.0 / B for B in range(1, 33)}), drafting)
    assert auto.lengths(None, survival, cap, 7).sum() < 8


def test_a_step_in_the_measured_curve_does_not_stop_admission():
    """A round's verify cost grows along the chord of the plain profile: a step in the measured
    curve (a tile boundary at B = 10) does not make Algorithm 1 stop before the drafts that
    pay for it."""
    steep = SPSProfile.from_pairs({B: 1.0 / B for B in range(1, 257)})
    stepped = SPSProfile.from_pairs({B: 1.0 / (1.0 + 0.01 * B + (0.5 if B >= 10 else 0.0))
                                     for B in range(1, 65)})
    drafting = SPSProfile.from_pairs({R: 0.4 for R in range(1, 33)})
    survival = torch.full((8, 7), 0.97).cumprod(1)
    lengths = AutoPolicy(steep, stepped, drafting).lengths(None, survival, torch.full((8,), 7), 7)
    assert lengths.tolist() == [7] * 8


@pytest.mark.parametrize("max_deferred", [None, 2])
def test_deferred_context_is_written_before_a_request_drafts(plain_tokens, max_deferred):
    """Long plain stretches (exploring with half the batch in turn): the rounds keep the
    features of the positions they commit and write their drafter context when the request
    drafts again, or when max_deferred positions wait. The context the prefix cache keeps equals
    that of drafting every round, as do the greedy tokens; pages whose context is still
    deferred are never shared."""
    from dspark_rt.runner.round import Round
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=2, explore_share=0.5)
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=pol, dtype="float64",
                                  calibration="none")
    if max_deferred is not None:
        dec.engine.round.max_deferred = max_deferred
    written, waiting = [], []
    commit = dec.engine.round.commit_context
    dec.engine.round.commit_context = lambda *a: written.append(commit(*a)) or written[-1]
    begin = pol.begin_round
    pol.begin_round = lambda ids, w=None: waiting.append(w) or begin(ids, w)
    outs = dec.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_tokens[:4]
    deferred = sum(not w for ws in written for w in ws)
    assert deferred > 20 and pol.rounds["speculative"] >= 3, (deferred, pol.rounds)
    # the policy is told, per request, how many positions wait for their context (it prices
    # exploring with them): none before the first plain round, never max_deferred or more
    most = max(max(w) for w in waiting)
    assert waiting[0] == [0] * 4 and 1 <= most < (max_deferred or Round.max_deferred), most
    assert not dec.engine.round.deferred  # finished requests hold no features
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
    # what a round holds, and drops: requests gone from the batch, rows not covering ctx..kv
    rnd = Round()
    f = torch.zeros(4, 3)
    rnd.deferred = {"a": [(f, 0), (f, 1)], "b": [(f, 2)], "gone": [(f, 3)]}
    from dspark_rt.runner.batch import SeqBatch
    batch = SeqBatch([10, 7, 5], [8, 5, 5], [[0]] * 3, [[0]] * 3, [1] * 3, [7] * 3,
                     [GREEDY] * 3, [0] * 3, [1] * 3, [1] * 3, ids=["a", "b", "c"])
    assert rnd.held(batch) == [False, True, False]
    assert set(rnd.deferred) == {"a"}


def test_deferred_features_lost_are_rebuilt_from_the_target(plain_tokens):
    """If the round loses what it deferred (here: dropped by hand mid-run), the request is
    rebuilt from the target (a prefill chunk over the missing positions) and drafts again:
    greedy tokens and the prefix-cached drafter context stay those of drafting every round."""
    pol = AutoPolicy(SPEC, SPEC.scaled(3.0), explore_every=4, explore_share=1.0)
    dec = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], policy=pol, dtype="float64",
                                  calibration="none")
    rnd = dec.engine.round
    rnd.max_deferred = 4  # written often: the prefix cache then keeps pages of it to compare
    calls, rebuilt, drafted_after = [0], [], []
    inner = rnd.held

    def held(batch):
        calls[0] += 1
        if calls[0] in (5, 9):  # some deferred context is held by then: drop it all
            assert rnd.deferred
            rnd.deferred.clear()
        lost = inner(batch)
        rebuilt.extend(lost)
        return lost
    rnd.held = held
    draft = rnd.draft
    rnd.draft = lambda *a: drafted_after.append(calls[0]) or draft(*a)
    outs = dec.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_tokens[:2]
    assert any(rebuilt) and max(drafted_after) > 9, (rebuilt, drafted_after)
    ref = Decoder.from_pretrained(TARGET, DRAFTERS["vanilla"], dtype="float64")
    for out, ref_out in zip(outs, ref.generate(PROMPTS[:2], GREEDY, use_tqdm=False)):
        got, want = _context(dec, out), _context(ref, ref_out)
        n = min(got.shape[1], want.shape[1])
        torch.testing.assert_close(got[:, :n], want[:, :n], rtol=1e-9, atol=1e-9)


def test_a_decision_is_reused_only_while_its_inputs_stand(plain_tokens):
    """A plain stretch reuses the last decision while the estimates and the batch are unchanged;
    over a whole run (explorations, per-request estimates, requests finishing) every round
    decides and drafts exactly as a policy that prices every round afresh."""
    class Afresh(AutoPolicy):
        def _decide(self, caps, gamma):
            self._last = None
            return super()._decide(caps, gamma)

    logs = []
    for cls in (AutoPolicy, Afresh):
        # profiles under which the estimates flip the decision during the run
        pol = cls(SPEC, SPEC.scaled(1.3), SPEC.scaled(0.9), explore_every=3, explore_share=0.25)
        log, speculates, draft_caps = [], pol.speculates, pol.draft_caps
        pol.speculates = lambda caps, g: log.append(("s", tuple(caps), speculates(caps, g))) or log[-1][2]
        pol.draft_caps = lambda caps: log.append(("d", tuple(draft_caps(caps)))) or list(log[-1][1])
        assert [o.token_ids for o in _run(pol)] == plain_tokens
        logs.append((log, dict(pol.rounds)))
    assert logs[0] == logs[1]
    decided = {entry[2] for entry in logs[1][0] if entry[0] == "s"}
    assert decided == {True, False}, logs[1][1]


def test_a_new_request_is_explored_when_its_drafts_could_pay():
    """The shared estimate says drafts rarely survive (other requests' text), and plain rounds
    have backed exploring off: a request that joins alone still drafts in its first round,
    because a speculative round of its drafts would pay clearly if they survived; its own
    survivals then decide. In a batch of 32 where even that best case loses, new requests decode
    plainly. A request is explored this way once."""
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
    drafting = SPSProfile([1, 8, 32], [80.0, 15.0, 5.0])
    pol = AutoPolicy(sps, plain, drafting, explore_every=16)
    pol.estimate = np.full(7, 0.05)
    pol._interval = 128  # backed off
    pol.begin_round(["old"])
    pol._tried.add("old")
    assert not pol.speculates([7], 7)  # a request it explored before: the estimate decides
    pol.begin_round(["new"])
    assert pol.speculates([7], 7) and pol.needs_confidence and pol.draft_caps([7]) == [7]
    pol.lengths(None, torch.full((1, 7), 0.95), torch.tensor([7]), 7)
    pol.begin_round(["new"])
    assert pol.speculates([7], 7)  # on its own estimate now
    pol2 = AutoPolicy(sps, plain, drafting, explore_every=16)
    pol2.estimate = np.full(7, 0.05)
    pol2._interval = 128
    pol2.begin_round([f"r{i}" for i in range(32)])
    assert not pol2.speculates([7] * 32, 7)
    pol3 = AutoPolicy(sps, plain, drafting, explore_every=16)
    pol3.estimate = np.full(7, 0.05)
    pol3._interval = 128
    pol3.begin_round(["a", "b"])
    assert pol3.speculates([7, 7], 7) and pol3.draft_caps([7, 7]) == [7, 0]  # one at a time
    pol3.lengths(None, torch.full((2, 7), 0.01), torch.tensor([7, 0]), 7)
    pol3.begin_round(["a", "b"])
    assert pol3.speculates([7, 7], 7) and pol3.draft_caps([7, 7]) == [0, 7]
    pol3.lengths(None, torch.full((2, 7), 0.01), torch.tensor([0, 7]), 7)
    pol3.begin_round(["a", "b"])
    assert not pol3.speculates([7, 7], 7)  # both tried, both poor: plain


@pytest.mark.parametrize("drafting_speed,budget_binds", [(50.0, True), (99.5, False)])
def test_exploring_spends_at_most_its_budget(drafting_speed, budget_binds):
    """Plain rounds win (no draft is expected to survive) and exploring is forced every 2
    rounds (backing off to 16 while the loss is clear). Where drafting one request costs a
    whole plain round (a CPU), exploring spends at most explore_budget of the plain rounds' time
    (plus the two rounds the credit starts with); where it costs a two-hundredth of one, the
    interval alone decides, as without a budget."""
    from dspark_rt.policies.auto import MAX_BACKOFF
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
    drafting = SPSProfile([1, 8, 32], [drafting_speed, 15.0, 5.0])
    cost = 1 / drafting_speed - 1 / 100.0  # seconds the drafting of one request adds
    counts = {}
    for budget in (0.02, 1.0):
        pol = AutoPolicy(sps, plain, drafting, explore_every=2, explore_budget=budget)
        pol.estimate = np.zeros(7)
        pol.begin_round(["a"])
        pol._tried.add("a")
        counts[budget] = sum(pol.speculates([7], 7) for _ in range(2000))
        assert pol.rounds["speculative"] == counts[budget]
    unbounded = counts[1.0]
    assert unbounded >= 2000 // (MAX_BACKOFF * 2)  # the interval alone: about one in 16
    if budget_binds:
        assert counts[0.02] * cost <= 0.02 * 2000 * 0.01 + 2 * cost
        assert counts[0.02] < unbounded / 2
    else:
        assert counts[0.02] == unbounded
    with pytest.raises(ValueError, match="explore_budget"):
        AutoPolicy(sps, plain, drafting, explore_budget=0.0)


def test_exploring_prices_the_context_it_writes_first():
    """A request that decoded plainly for a while writes the drafter context of those positions
    before it drafts. With the context profile, exploring a request with 100 such positions
    costs (here) about a plain round more, so within the same budget it explores less often than
    a request with none waiting, and exploring spends at most its budget counting that cost."""
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
    drafting = SPSProfile([1, 8, 32], [99.5, 15.0, 5.0])   # drafting one request: 0.05 ms
    context = SPSProfile([1, 64, 128], [2000.0, 200.0, 100.0])  # 128 positions: 10 ms
    counts, costs = {}, {}
    for waiting in (0, 100):
        pol = AutoPolicy(sps, plain, drafting, context, explore_every=2)
        pol.estimate = np.zeros(7)
        pol._tried.add("a")
        n = 0
        for _ in range(2000):
            pol.begin_round(["a"], [waiting])
            n += pol.speculates([7], 7)
        counts[waiting], costs[waiting] = n, pol._explore_cost([0])
    assert costs[100] > 10 * costs[0]
    assert counts[0] == 1000  # every second round: the interval alone
    assert counts[100] < counts[0] / 4
    assert counts[100] * costs[100] <= 0.02 * 2000 * 0.01 + 2 * costs[100]


def test_the_credit_prices_the_rows_that_draft_and_holds_two_rounds():
    """The credit is spent on the rows an exploring round drafts for (the rotation's, with their
    own deferred context), holds at most two exploring rounds whatever the stretch before it,
    and is not spent while no row may draft (requests that opted out of speculation)."""
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
    drafting = SPSProfile([1, 8, 32], [50.0, 15.0, 5.0])
    context = SPSProfile([1, 64, 128], [2000.0, 200.0, 100.0])
    ids = list("abcdefgh")
    # R = 8, explore_share 1/4: the rotation drafts for rows 6 and 7 next; it is charged their
    # drafting and their 150 deferred positions, not anyone else's
    pol = AutoPolicy(sps, plain, drafting, context, explore_every=1, explore_share=0.25)
    pol.estimate = np.zeros(7)
    pol._tried.update(ids)
    pol._explore_from = 6
    waiting = [0, 0, 0, 0, 0, 0, 50, 100]
    pol.begin_round(ids, waiting)
    pol._credit = 10.0  # plenty; the cap cuts it to two rounds of these rows
    want = pol._explore_cost([6, 7])
    assert want > pol._explore_cost([0, 1]) > 0
    assert pol.speculates([7] * 8, 7) and pol.draft_caps([7] * 8) == [0] * 6 + [7, 7]
    assert pol._credit == pytest.approx(want, rel=1e-6)  # two rounds of these rows, one spent
    # a long speculative stretch (the estimates say every draft pays) banks no more than two
    # exploring rounds: once plain rounds win, exploring every round is cut to the budget
    pol = AutoPolicy(sps, plain, drafting, explore_every=1)
    pol.estimate = np.full(7, 0.95)
    pol._tried.add("a")
    for _ in range(500):
        pol.begin_round(["a"])
        assert pol.speculates([7], 7) and not pol._explore
    pol.estimate = np.zeros(7)
    explored = 0
    for _ in range(20):
        pol.begin_round(["a"])
        explored += pol.speculates([7], 7)
    assert 1 <= explored <= 2  # 20 plain rounds add 0.4 of one exploring round's 10 ms
    # while no request may draft (speculative=False), nothing is spent: exploring resumes at
    # once when one may
    pol = AutoPolicy(sps, plain, drafting, explore_every=2)
    for _ in range(1000):
        pol.speculates([0], 7)
    assert pol._credit is None  # nothing priced or spent: it starts full when one may draft
    pol.estimate = np.zeros(7)
    assert any(pol.speculates([7], 7) for _ in range(3))


def test_it_speculates_only_on_a_clear_expected_gain():
    """The profiles leave out the host scheduling of a speculative round, so a round speculates
    on the estimates' word only when they expect SPEC_GAIN over a plain round: an expected 1.05x
    decodes plainly, 1.2x drafts."""
    from dspark_rt.policies.auto import SPEC_GAIN
    plain = SPSProfile([1, 8, 32, 64], [100.0, 90.0, 60.0, 40.0])
    sps = SPSProfile([1, 8, 32, 64], [80.0, 75.0, 50.0, 35.0])
    drafting = SPSProfile([1, 8, 32], [50.0, 15.0, 5.0])
    pol = AutoPolicy(sps, plain, drafting)
    seen = []
    for c in np.linspace(0.05, 0.99, 95):
        pol.estimate = np.full(7, c)
        spec = pol._decide([7], 7)[0]
        seen.append((pol._margin, spec))
        assert spec == (pol._margin > SPEC_GAIN), (c, pol._margin)
    assert any(1.0 < m <= SPEC_GAIN for m, _ in seen) and any(s for _, s in seen)
