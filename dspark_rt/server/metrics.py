"""Prometheus metrics, prefixed `dspark_rt:`, with vLLM's meanings (vllm:spec_decode_* and the
request basics), in a registry of their own (several servers in one process do not collide).

Speculative counters grow when a request leaves (finished, aborted or failed) by its whole
SpecMetrics, so the sum of the per-request `metrics.speculative_decoding` of every request
equals the counters exactly:
  spec_decode_num_drafts_total            rounds (spec steps) of every request
  spec_decode_num_draft_tokens_total      drafts sent to verification
  spec_decode_num_accepted_tokens_total   drafts accepted
  spec_decode_num_accepted_tokens_per_pos_total{position=k}   accepted at draft position k (0-based)
"""
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

P = "dspark_rt:"
# seconds; the CPU runs of the shipped pair sit at the low end, an 8B model's long answers high
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)
_TPOT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
         5.0, 10.0)
_E2E = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
        50.0, 60.0, 120.0, 240.0, 480.0)


class Metrics:
    def __init__(self, model_name: str, gamma: int):
        self.registry = r = CollectorRegistry()
        self.model, self.gamma = model_name, gamma
        lab = ["model_name"]
        self.running = Gauge(P + "num_requests_running", "Requests in the running batch.", lab,
                             registry=r).labels(model_name)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a batch slot.", lab,
                             registry=r).labels(model_name)
        self.success = Counter(P + "request_success", "Requests that left, by finish reason "
                               "(stop, length, abort, error).", lab + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of requests that left.",
                                     lab, registry=r).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens emitted by requests "
                                         "that left.", lab, registry=r).labels(model_name)
        self.drafts = Counter(P + "spec_decode_num_drafts", "Speculative rounds (spec steps), "
                              "summed over requests.", lab, registry=r).labels(model_name)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens sent to "
                                    "verification.", lab, registry=r).labels(model_name)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                lab, registry=r).labels(model_name)
        per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                          "at each draft position (0-based).", lab + ["position"], registry=r)
        self.accepted_per_pos = [per_pos.labels(model_name, str(k)) for k in range(gamma)]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token.", lab,
                              buckets=_TTFT, registry=r).labels(model_name)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Per request: (last token - "
                              "first token) / (tokens - 1).", lab, buckets=_TPOT,
                              registry=r).labels(model_name)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=_E2E, registry=r).labels(model_name)

    # engine thread
    def queue(self, running: int, waiting: int):
        self.running.set(running)
        self.waiting.set(waiting)

    def finished(self, out):
        """A request left: its tokens and its speculative counts (outputs.RequestOutput)."""
        m = out.metrics
        self.success.labels(self.model, out.finish_reason).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.drafts.inc(m.num_rounds)
        self.draft_tokens.inc(m.num_draft_tokens)
        self.accepted.inc(m.num_accepted_tokens)
        for c, n in zip(self.accepted_per_pos, m.accepted_by_position):
            c.inc(n)

    # event loop: latencies as the client sees them
    def latency(self, arrival: float, first: float | None, last: float, n_tokens: int):
        if first is not None:
            self.ttft.observe(first - arrival)
            if n_tokens > 1:
                self.tpot.observe((last - first) / (n_tokens - 1))
        self.e2e.observe(last - arrival)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
