"""What the engine thread learns from each step, for the metrics and the periodic log line.

After every Engine.step, from the engine's public state (engine.scheduler, the block managers,
each live request's own fields): when each request was first scheduled, got its first and its
latest tokens (RequestTimes), the tokens of the step, preemptions, KV-cache usage, and how far
each request's speculative metrics grew. The scheduler keeps no prefix-cache counters, so the
target cache's prefix lookups (BlockManager.match_prefix, one per admission) are counted here.
"""
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("dspark_rt.server")


@dataclass
class RequestTimes:
    """time.monotonic() seconds of one request: it arrived, was first scheduled, got its first
    and its latest tokens, left."""
    arrival: float
    scheduled: float | None = None
    first: float | None = None
    last: float | None = None
    left: float | None = None


@dataclass
class _Seen:
    """The part of a request's SpecMetrics already counted."""
    rounds: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: tuple = ()


def drafted_rounds(m) -> int:
    """Rounds that verified at least one draft (every such round verified position 0)."""
    return m.verified_by_position[0] if m.verified_by_position else 0


class _PrefixCount:
    """Counts the target cache's prefix lookups: tokens asked for, tokens found cached."""

    def __init__(self, blocks):
        self.queries = self.hits = 0
        match = blocks.match_prefix

        def counted(seq_id, token_ids, max_tokens=None):
            pages, cached = match(seq_id, token_ids, max_tokens)
            self.queries += len(token_ids)
            self.hits += cached
            return pages, cached
        blocks.match_prefix = counted


class StepStats:
    """engine: the Engine the thread steps; metrics: a Metrics (or None); log_interval: seconds
    between stats lines (0: none)."""

    def __init__(self, engine, metrics, log_interval: float = 0.0):
        self.engine, self.metrics, self.log_interval = engine, metrics, log_interval
        self._prefix = _PrefixCount(engine.target_blocks)
        self._counted_prefix = (0, 0)
        self._preemptions = engine.scheduler.num_preemptions
        self._last_log = time.monotonic()
        self._window = dict(prompt=0, generation=0, drafts=0, accepted=0)

    def stepped(self, live: dict, outs, t0: float, t1: float):
        """After one step that began at t0 and ended at t1. live: request id -> Submission (each
        with .req, .times, .seen), before the finished ones are taken out."""
        for sub in live.values():
            r = sub.req
            if sub.times.scheduled is None and (r.kv_len or r.output_ids or r.finished):
                sub.times.scheduled = t0
        prompt = generation = 0
        for o in outs:
            sub, n = live.get(o.request_id), len(o.new_token_ids)
            if sub is None or not n:
                continue
            generation += n
            t = sub.times
            if t.first is None:
                t.first, n = t1, n - 1
                prompt += len(sub.req.prompt_ids)
                if self.metrics is not None:
                    self.metrics.ttft.observe(t1 - t.arrival)
            if self.metrics is not None and n > 0 and t.last is not None:
                # a round emits several tokens at once: each gets an equal share of the interval
                for _ in range(n):
                    self.metrics.itl.observe((t1 - t.last) / n)
            t.last = t1
        w = self._window
        w["prompt"] += prompt
        w["generation"] += generation
        self._spec(live.values())
        m = self.metrics
        if m is not None:
            m.prompt_tokens.inc(prompt)
            m.generation_tokens.inc(generation)
            if prompt or generation:
                m.iteration_tokens.observe(prompt + generation)
            n = self.engine.scheduler.num_preemptions
            m.preemptions.inc(n - self._preemptions)
            self._preemptions = n
            q, h = self._prefix.queries, self._prefix.hits
            m.prefix_queries.inc(q - self._counted_prefix[0])
            m.prefix_hits.inc(h - self._counted_prefix[1])
            self._counted_prefix = (q, h)

    def _spec(self, subs):
        """Grows the speculative counters by what each request's metrics grew this step."""
        m, w = self.metrics, self._window
        for sub in subs:
            s, seen = sub.req.metrics, sub.seen
            drafts = drafted_rounds(s)
            if s.num_rounds == seen.rounds:
                continue
            w["drafts"] += drafts - seen.drafts
            w["accepted"] += s.num_accepted_draft_tokens - seen.accepted
            if m is not None:
                m.rounds.inc(s.num_rounds - seen.rounds)
                m.drafts.inc(drafts - seen.drafts)
                m.draft_tokens.inc(s.num_draft_tokens - seen.draft_tokens)
                m.accepted.inc(s.num_accepted_draft_tokens - seen.accepted)
                old = seen.per_pos or (0,) * len(s.num_accepted_tokens_per_pos)
                for c, now, before in zip(m.accepted_per_pos, s.num_accepted_tokens_per_pos, old):
                    c.inc(now - before)
            sub.seen = _Seen(s.num_rounds, drafts, s.num_draft_tokens, s.num_accepted_draft_tokens,
                             tuple(s.num_accepted_tokens_per_pos))

    def state(self):
        """Gauges after a step (or an abort): queue lengths and KV-cache usage."""
        eng = self.engine
        if self.metrics is not None:
            self.metrics.running.set(eng.num_running)
            self.metrics.waiting.set(eng.num_waiting)
            self.metrics.kv_usage.set(self.kv_usage())

    def kv_usage(self) -> float:
        eng = self.engine
        caches = [bm for bm in (eng.target_blocks, eng.drafter_blocks) if bm is not None]
        return max(bm.num_used / bm.num_pages for bm in caches)

    def maybe_log(self, now: float | None = None):
        """The stats line, once per log_interval: throughput since the last line, the queue,
        KV-cache usage and the acceptance length of the rounds that drafted. Quiet (debug) while
        the server idles."""
        now = time.monotonic() if now is None else now
        dt = now - self._last_log
        if not self.log_interval or dt < self.log_interval:
            return
        w, eng = self._window, self.engine
        idle = not (w["prompt"] or w["generation"] or eng.num_running or eng.num_waiting)
        tau = f"{1 + w['accepted'] / w['drafts']:.2f}" if w["drafts"] else "-"
        (log.debug if idle else log.info)(
            "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, "
            "waiting %d, KV cache usage %.1f%%, acceptance length %s (%d drafted rounds)",
            w["prompt"] / dt, w["generation"] / dt, eng.num_running, eng.num_waiting,
            100 * self.kv_usage(), tau, w["drafts"])
        self._last_log = now
        self._window = dict(prompt=0, generation=0, drafts=0, accepted=0)
