"""RequestScheduler: chunked prefill, decode rounds, budgets, watermark, preemption, abort, prefix
caching; and a stateful property test driving it with a simulated engine that tracks the token
each cache slot holds."""
import random

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dspark_rt.engine import (BlockManager, RequestScheduler, SchedRequest, all_tokens,
                              prefill_len)


class Sim:
    """The engine's side of the contract (dspark_rt.engine docstring), with checks. draw(lo, hi)
    picks an int in [lo, hi]: how many tokens a round commits, and the token values."""

    def __init__(self, sched: RequestScheduler, draw):
        self.s, self.draw = sched, draw
        self.content = {"target": {}, "drafter": {}}   # (page, offset) -> token
        self.reqs, self.finished, self.aborted, self.preempted = {}, [], set(), set()
        self.steps = self.hits = 0

    def add(self, rid, prompt, max_tokens):
        req = SchedRequest(rid, list(prompt), max_tokens)
        self.s.add(req)
        self.reqs[rid] = req
        return req

    def _write(self, bm, pages, lo, hi, tokens):
        for pos in range(lo, hi):
            page = pages[pos // bm.page_size]
            assert bm.ref_count(page) == 1 and bm.page_hash(page) is None, \
                f"{bm.name} page {page} is shared or cached but position {pos} is written"
            self.content[bm.name][page, pos % bm.page_size] = tokens(pos)

    def _read_ok(self, bm, pages, lo, hi, toks):
        return all(self.content[bm.name].get((pages[p // bm.page_size], p % bm.page_size)) == toks[p]
                   for p in range(lo, hi))

    def _finish(self, req):
        self.s.finish(req.request_id)
        self.finished.append(req.request_id)

    def step(self):
        s, gamma, B = self.s, self.s.gamma, self.s.block_size
        t, d = s.target, s.drafter
        was_running, live = {id(r) for r in s.running}, s.has_unfinished()
        out = s.schedule()
        self.steps += 1
        # Liveness, per step: the oldest running request always fits (alone, it fits the pool;
        # newer ones are preempted first) and a fresh budget holds a round or a 1-token chunk.
        assert out.is_empty != live, "live requests but nothing scheduled"
        ids = [r.request_id for r in out.decodes] + [c.req.request_id for c in out.prefills]
        assert len(ids) == len(set(ids)) and all(i in s for i in ids)
        assert out.num_batched_tokens == sum(c.num_tokens for c in out.prefills) + \
            len(out.decodes) * (1 + gamma) <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        for req in out.preempted:
            self.preempted.add(req.request_id)
            assert req.kv_len == req.ctx_len == 0 and not req.target_pages
            assert req.request_id not in ids and any(r is req for r in s.waiting)
        for c in out.prefills:
            req = c.req
            toks = all_tokens(req, prefill_len(req))
            assert c.num_tokens >= 1 and c.end <= prefill_len(req)
            self.hits += id(req) not in was_running and c.target_from > 0
            assert c.start == (req.kv_len if d is None else min(req.kv_len, req.ctx_len))
            assert c.target_from == req.kv_len and req.target_pages == t.block_table(req.request_id)
            assert len(req.target_pages) * t.page_size >= max(req.kv_len, c.end)
            # Cached target positions below target_from are read, never written.
            assert self._read_ok(t, req.target_pages, 0, req.kv_len, toks)
            self._write(t, req.target_pages, max(c.start, req.kv_len), c.end, toks.__getitem__)
            if d is not None:
                assert len(req.drafter_pages) * d.page_size >= c.end
                assert self._read_ok(d, req.drafter_pages, 0, req.ctx_len, toks)
                self._write(d, req.drafter_pages, c.start, c.end, toks.__getitem__)
            req.kv_len, req.ctx_len = max(req.kv_len, c.end), c.end
            if c.is_last and not req.output_ids:
                req.output_ids.append(self.draw(0, 2))        # round 0: the first token
                if len(req.output_ids) >= req.max_tokens:
                    self._finish(req)
        for req in out.decodes:
            kv, ctx = req.kv_len, req.ctx_len
            assert kv == prefill_len(req) and (d is None or ctx == kv) and req.output_ids
            assert len(req.target_pages) * t.page_size >= kv + 1 + gamma
            drafts = [self.draw(0, 2) for _ in range(gamma)]
            if d is not None:
                assert len(req.drafter_pages) * d.page_size >= ctx + max(B, gamma + 1)
                self._write(d, req.drafter_pages, ctx, ctx + B, lambda p: -2)   # block scratch
            chain = [req.output_ids[-1]] + drafts                 # anchor + drafts, verified
            self._write(t, req.target_pages, kv, kv + 1 + gamma, lambda p: chain[p - kv])
            c = self.draw(1, min(gamma + 1, req.max_tokens - len(req.output_ids)))
            req.output_ids += drafts[:c - 1] + [self.draw(0, 2)]
            req.kv_len += c
            if d is not None:                                     # context of anchor + accepted
                toks = all_tokens(req)
                self._write(d, req.drafter_pages, ctx, ctx + c, toks.__getitem__)
                req.ctx_len += c
            if len(req.output_ids) >= req.max_tokens:
                self._finish(req)
        return out

    def abort(self, rid):
        live = rid in self.reqs and rid not in self.aborted and rid not in self.finished
        assert self.s.abort(rid) == live
        if live:
            self.aborted.add(rid)

    def drain(self, max_steps=5000):
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                break
            self.step()
        assert not self.s.has_unfinished(), f"not done after {max_steps} steps: " \
            f"{len(self.s.waiting)} waiting, {len(self.s.running)} running"

    def check(self):
        s = self.s
        for bm in (s.target, s.drafter):
            if bm is None:
                continue
            bm.check()
            assert bm.num_seqs == len(s.running)
            if not s.has_unfinished():
                assert bm.num_free == bm.num_pages
        live = [r.request_id for r in s.running] + [r.request_id for r in s.waiting]
        expect = set(self.reqs) - self.aborted - set(self.finished)
        assert len(live) == len(set(live)) and set(live) == expect
        assert len(self.finished) == len(set(self.finished))
        for r in s.waiting:
            assert r.kv_len == r.ctx_len == 0 and not s.target.has_seq(r.request_id)
        for r in s.running:                        # committed K/V intact in both caches
            toks = all_tokens(r)
            assert self._read_ok(s.target, s.target.block_table(r.request_id), 0,
                                 min(r.kv_len, len(toks)), toks)
            if s.drafter is not None:
                assert self._read_ok(s.drafter, s.drafter.block_table(r.request_id), 0,
                                     min(r.ctx_len, len(toks)), toks)


def make(num_pages=32, page_size=4, gamma=3, block_size=3, drafter=True, drafter_cache=True,
         target_cache=True, drafter_pages=None, drafter_page_size=None, **kwargs):
    t = BlockManager(num_pages, page_size, name="target", enable_prefix_caching=target_cache)
    d = BlockManager(drafter_pages or num_pages, drafter_page_size or page_size, name="drafter",
                     enable_prefix_caching=drafter_cache) if drafter else None
    kwargs.setdefault("max_num_seqs", 4)
    kwargs.setdefault("max_num_batched_tokens", 16)
    return RequestScheduler(target_blocks=t, drafter_blocks=d, gamma=gamma if drafter else 0,
                            block_size=block_size, **kwargs)


def sim_of(sched, seed=0):
    rng = random.Random(seed)
    return Sim(sched, rng.randint)


def run_until(sim, done, max_steps=500):
    """Steps until done(); bounded, so a scheduler that stops scheduling fails, not hangs."""
    outs = []
    for _ in range(max_steps):
        if done():
            return outs
        outs.append(sim.step())
        sim.check()
    raise AssertionError(f"condition not reached in {max_steps} steps")


def test_chunked_prefill_then_rounds():
    sim = sim_of(make(chunk_size=4, max_num_batched_tokens=8))
    req = sim.add(0, range(10), 6)
    chunks = [(c.start, c.end) for o in run_until(sim, lambda: req.output_ids) for c in o.prefills]
    assert chunks == [(0, 4), (4, 8), (8, 10)] and req.kv_len == req.ctx_len == 10
    out = sim.step()
    assert out.decodes == [req] and out.num_batched_tokens == 4
    assert len(req.target_pages) == 4 and len(req.drafter_pages) == 4   # 10+1+3 and 10+4
    sim.drain()
    assert sim.finished == [0] and sim.s.target.num_free == 32


def test_prefill_mixes_with_rounds_under_the_budget():
    sim = sim_of(make(chunk_size=16, max_num_batched_tokens=10))
    sim.add(0, [1, 2], 20)
    sim.step()
    sim.add(1, range(30), 4)
    out = sim.step()                       # a round (4 tokens) + 6 prompt tokens
    assert len(out.decodes) == 1 and [(c.start, c.num_tokens) for c in out.prefills] == [(0, 6)]
    out = sim.step()
    assert len(out.decodes) == 1 and out.prefills[0].start == 6 and out.num_batched_tokens == 10
    sim.drain()
    sim.check()


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_by_recompute_and_resume(caching):
    # 12 pages of 2: each request alone fits (prompt 4 + 12 tokens + gamma 3 = 19 -> 10 pages).
    sim = sim_of(make(num_pages=12, page_size=2, max_num_seqs=2, watermark=0.0,
                      drafter_cache=caching, target_cache=caching), seed=3)
    a, b = sim.add("a", [1, 2, 3, 4], 12), sim.add("b", [5, 6, 7, 8], 12)
    run_until(sim, lambda: "b" in sim.preempted)
    assert b.kv_len == 0 and sim.s.waiting[0] is b and b.output_ids   # front of waiting
    kept = list(b.output_ids)
    outs = run_until(sim, lambda: 0 < b.kv_len == prefill_len(b))
    chunks = [c for o in outs for c in o.prefills if c.req is b]
    # The re-prefill covers prompt + emitted tokens but the anchor, and samples nothing. With
    # prefix caching, b's committed full pages were cached before the preemption freed them.
    first = chunks[0]
    assert first.start == first.target_from and (first.start > 0) == caching
    assert chunks[-1].is_last and b.output_ids == kept
    assert b.kv_len == b.ctx_len == 4 + len(kept) - 1
    sim.drain()
    assert sorted(sim.finished) == ["a", "b"] and len(a.output_ids) == len(b.output_ids) == 12
    assert sim.s.target.num_free == sim.s.drafter.num_free == 12 and sim.s.num_preemptions >= 1


def test_abort_and_errors():
    sim = sim_of(make(max_num_seqs=1))
    sim.add(0, [1, 2, 3], 5), sim.add(1, [4, 5], 5)
    sim.step()
    used = sim.s.target.num_used
    assert used > 0 and sim.s.abort(0) and sim.s.target.num_free == 32
    assert not sim.s.abort(0) and not sim.s.abort(99)
    out = sim.step()
    assert [c.req.request_id for c in out.prefills] == [1]
    assert sim.s.abort(1) and not sim.s.has_unfinished()
    assert all(c.req.request_id not in (0, 1) for c in sim.s.schedule().prefills)
    with pytest.raises(KeyError, match="request 0 is not live"):
        sim.s.finish(0)
    sim.add(2, [1], 3)
    with pytest.raises(ValueError, match="request 2 is already scheduled"):
        sim.s.add(SchedRequest(2, [1], 3))
    with pytest.raises(ValueError, match=r"request 3: up to 130 positions need 33 pages of 4, "
                                         r"the target cache has 32"):
        sim.s.add(SchedRequest(3, [1] * 100, 27))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(max_num_batched_tokens=3)


def test_first_token_must_be_sampled():
    s = make()
    req = SchedRequest(0, [1, 2], 4)
    s.add(req)
    s.schedule()
    req.kv_len = req.ctx_len = 2                 # the engine forgot to sample
    with pytest.raises(RuntimeError, match="request 0 finished its prefill without a first"):
        s.schedule()


@pytest.mark.parametrize("drafter_cache", [True, False])
def test_prefix_cache_through_the_scheduler(drafter_cache):
    sim = sim_of(make(page_size=4, drafter_cache=drafter_cache, chunk_size=64,
                      max_num_batched_tokens=64))
    system = list(range(10, 23))                 # 13 tokens: 3 full pages
    sim.add(0, system + [1], 2)
    sim.drain()
    sim.add(1, system + [2, 3], 2)
    out = sim.step()
    (c,) = out.prefills
    assert c.target_from == 12 and sim.reqs[1].target_pages[:3] == sim.s.target.lookup_prefix(system)
    # Cache mode: both caches hit, only the new tokens run. Rebuild mode: the drafter context of
    # the prefix is rebuilt, so the chunk starts at 0 and skips target writes below 12.
    assert (c.start, c.end) == ((12, 15) if drafter_cache else (0, 15))
    sim.drain()
    sim.check()


def test_drafter_hit_shorter_than_target_hit():
    sim = sim_of(make(num_pages=32, drafter_pages=8, chunk_size=64, max_num_batched_tokens=64))
    system = list(range(10, 23))
    sim.add(0, system + [1], 1)
    sim.drain()                                  # 3 full pages cached in both caches
    sim.add(1, [5] * 24, 1)                      # 6 drafter pages: evicts the drafter's page 2
    sim.drain()
    assert len(sim.s.target.lookup_prefix(system)) == 3
    assert len(sim.s.drafter.lookup_prefix(system)) == 2
    sim.add(2, system + [2, 3], 1)
    (c,) = sim.step().prefills
    assert (c.start, c.target_from, c.end) == (8, 12, 15)
    sim.drain()
    sim.check()


def test_watermark_blocks_admission_only_while_something_runs():
    sim = sim_of(make(num_pages=10, page_size=4, watermark=0.5, max_num_batched_tokens=40,
                      chunk_size=40), seed=1)
    sim.add(0, [1] * 8, 4)
    sim.step()
    sim.add(1, [2] * 12, 4)                     # 3 + watermark 5 pages > the 6 left
    out = sim.step()
    assert not out.prefills and len(sim.s.waiting) == 1
    sim.drain()
    assert sorted(sim.finished) == [0, 1]


def test_watermark_never_stalls_an_empty_engine():
    # 7 pages of prompt + a 5-page watermark exceed the pool: admitted anyway when nothing runs.
    sim = sim_of(make(num_pages=10, page_size=4, watermark=0.5, max_num_batched_tokens=40,
                      chunk_size=40))
    sim.add(0, [1] * 28, 4)
    assert [c.num_tokens for c in sim.step().prefills] == [28]
    sim.drain()


def test_budget_does_not_leak_across_steps():
    sim = sim_of(make(max_num_seqs=3, max_num_batched_tokens=8, chunk_size=5), seed=2)
    for i in range(40):
        sim.add(i, [i % 3] * (1 + i % 7), 1 + i % 5)
    sim.drain(2000)
    assert sorted(sim.finished) == list(range(40))


# -- stateful ----------------------------------------------------------------------------------

# (shared prefix length, suffix, max_tokens) of a request
REQ = st.tuples(st.integers(0, 8), st.lists(st.integers(0, 2), max_size=4), st.integers(1, 12))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(data=st.data(), gamma=st.integers(0, 3), page_size=st.sampled_from([1, 2, 4]),
                num_pages=st.integers(4, 14), mode=st.sampled_from(["ar", "cache", "rebuild"]),
                max_num_seqs=st.integers(1, 4), chunk_size=st.integers(1, 8),
                watermark=st.sampled_from([0.0, 0.0, 0.1, 0.3]))
    def setup(self, data, gamma, page_size, num_pages, mode, max_num_seqs, chunk_size, watermark):
        drafter = mode != "ar" and gamma > 0
        budget = data.draw(st.integers(1 + gamma, 3 * (1 + gamma) + 6), label="budget")
        # The drafter's pool (and page size) may differ: its hits and evictions then differ too.
        self.sched = make(num_pages, page_size, gamma, gamma + data.draw(st.integers(0, 1)),
                          drafter, mode == "cache", max_num_seqs=max_num_seqs,
                          drafter_pages=data.draw(st.integers(4, 14), label="drafter pages"),
                          drafter_page_size=data.draw(st.sampled_from([page_size, 1, 2, 4])),
                          max_num_batched_tokens=budget, chunk_size=chunk_size, watermark=watermark)
        self.draw = lambda lo, hi: data.draw(st.integers(lo, hi))
        self.sim = Sim(self.sched, lambda lo, hi: self.draw(lo, hi))
        self.next_id = 0
        # A burst of requests up front: memory pressure (and preemption) early in the run.
        self.add(data.draw(st.lists(REQ, max_size=6), label="burst"))

    @rule(reqs=st.lists(REQ, min_size=1, max_size=3))
    def add(self, reqs):
        for shared, suffix, max_tokens in reqs:
            prompt = [7, 3, 7, 7, 3, 3, 7, 3][:shared] + suffix or [5]
            rid, self.next_id = self.next_id, self.next_id + 1
            try:
                self.sim.add(rid, prompt, max_tokens)
            except ValueError as e:
                assert "pages" in str(e)

    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data, n):
        self.draw = lambda lo, hi: data.draw(st.integers(lo, hi))
        for _ in range(n):
            hits = self.sim.hits
            out = self.sim.step()
            if out.preempted:
                event("preempted")
            if self.sim.hits > hits:
                event("prefix hit")

    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.integers(-1, self.next_id))
        self.sim.abort(rid)

    @precondition(lambda self: any(r.output_ids for r in self.sched.running))
    @rule(data=st.data())
    def stop_token(self, data):
        req = data.draw(st.sampled_from([r for r in self.sched.running if r.output_ids]))
        self.sim._finish(req)

    @invariant()
    def consistent(self):
        self.sim.check()

    def teardown(self):
        # Liveness: with steps continuing, every live request finishes (preempted ones too).
        rng = random.Random(0)
        self.draw = rng.randint
        self.sim.drain()
        self.sim.check()
        if self.sim.preempted:
            event("preempted (any time)")
        done = set(self.sim.finished) | self.sim.aborted
        assert done == set(self.sim.reqs) and self.sim.preempted <= done


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
