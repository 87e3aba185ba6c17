"""Prometheus metrics under vLLM's names (vllm/v1/metrics), prefixed `dspark_rt:` instead of
`vllm:`, label `model_name`, in a registry of their own (several servers in one process do not
collide), with the process collector; text or OpenMetrics as the scraper's Accept header asks.

Speculative counters count only rounds that drafted (verified at least one draft), as vLLM
counts only steps with a proposal: a `speculative: false` request, or a round the auto policy
ran plainly, adds nothing to them; `spec_decode_num_rounds` counts every round, so
num_drafts / num_rounds is the share of rounds that drafted. They grow per engine step by what
each request's metrics grew, so once requests have left the sum of their per-request
`metrics.speculative_decoding` equals the counters exactly:
  spec_decode_num_drafts_total            rounds that drafted
  spec_decode_num_draft_tokens_total      drafts sent to verification
  spec_decode_num_accepted_tokens_total   drafts accepted
  spec_decode_num_accepted_tokens_per_pos_total{position=k}   accepted at draft position k (0-based)
"""
from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               ProcessCollector)
from prometheus_client.exposition import choose_encoder

P = "dspark_rt:"
# seconds, vLLM's buckets; the CPU runs of the shipped pair sit at the low end
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
        5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(top: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to top (token-count histograms, as vLLM's)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return out
            out.append(m * scale)
        scale *= 10


class Metrics:
    """model_name: the label value; gamma: draft positions (per-position counters);
    max_model_len: the top of the token-count histograms."""

    def __init__(self, model_name: str, gamma: int, max_model_len: int = 1 << 20):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self.model, self.gamma = model_name, gamma
        lab = ["model_name"]

        def one(kind, name, doc, **kw):
            return kind(P + name, doc, lab, registry=r, **kw).labels(model_name)

        # scheduler state, set after every engine step
        self.running = one(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = one(Gauge, "num_requests_waiting", "Requests waiting for a batch slot.")
        self.kv_usage = one(Gauge, "kv_cache_usage_perc", "KV-cache usage, 1 = 100%: used pages "
                            "of the fuller of the target's and the drafter's caches.")
        self.prefix_queries = one(Counter, "prefix_cache_queries", "Prefix cache queries, in "
                                  "tokens looked up (target cache).")
        self.prefix_hits = one(Counter, "prefix_cache_hits", "Prefix cache hits, in cached tokens "
                               "(target cache).")
        self.preemptions = one(Counter, "num_preemptions", "Requests preempted (recomputed).")
        # tokens
        self.prompt_tokens = one(Counter, "prompt_tokens", "Prompt tokens of requests, counted "
                                 "when their first token comes.")
        self.generation_tokens = one(Counter, "generation_tokens", "Tokens emitted.")
        self.iteration_tokens = one(Histogram, "iteration_tokens_total", "Tokens per engine step: "
                                    "emitted, plus the prompts of requests whose first token "
                                    "came in it.", buckets=_ITERATION)
        lengths = buckets_1_2_5(max_model_len)
        self.request_prompt = one(Histogram, "request_prompt_tokens", "Prompt tokens per "
                                  "request.", buckets=lengths)
        self.request_generation = one(Histogram, "request_generation_tokens", "Tokens emitted "
                                      "per request.", buckets=lengths)
        self.request_max_tokens = one(Histogram, "request_params_max_tokens", "The max_tokens "
                                      "of requests.", buckets=lengths)
        self.success = Counter(P + "request_success", "Requests that left, by finish reason "
                               "(stop, length, abort, error).", lab + ["finished_reason"], registry=r)
        # times (seconds): arrival -> scheduled (queue) -> first token (prefill) -> last (decode)
        self.ttft = one(Histogram, "time_to_first_token_seconds", "Arrival to first token.",
                        buckets=_TTFT)
        self.itl = one(Histogram, "inter_token_latency_seconds", "Per emitted token after the "
                       "first: the step's interval over the tokens the step emitted.", buckets=_ITL)
        self.tpot = one(Histogram, "request_time_per_output_token_seconds", "Per request: decode "
                        "time / (tokens - 1).", buckets=_ITL)
        self.e2e = one(Histogram, "e2e_request_latency_seconds", "Arrival to leaving.",
                       buckets=_REQUEST)
        self.queue_time = one(Histogram, "request_queue_time_seconds", "Arrival to first "
                              "scheduled.", buckets=_REQUEST)
        self.prefill_time = one(Histogram, "request_prefill_time_seconds", "First scheduled to "
                                "first token.", buckets=_REQUEST)
        self.decode_time = one(Histogram, "request_decode_time_seconds", "First token to last "
                               "token.", buckets=_REQUEST)
        self.inference_time = one(Histogram, "request_inference_time_seconds", "First scheduled "
                                  "to last token.", buckets=_REQUEST)
        # speculative decoding
        self.rounds = one(Counter, "spec_decode_num_rounds", "Rounds of requests, drafted or not "
                          "(dspark_rt's own; num_drafts / num_rounds: the share that drafted).")
        self.drafts = one(Counter, "spec_decode_num_drafts", "Rounds that drafted (verified at "
                          "least one draft).")
        self.draft_tokens = one(Counter, "spec_decode_num_draft_tokens", "Draft tokens sent to "
                                "verification.")
        self.accepted = one(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                          "at each draft position (0-based).", lab + ["position"], registry=r)
        self.accepted_per_pos = [per_pos.labels(model_name, str(k)) for k in range(gamma)]

    def finished(self, out, times=None, max_tokens: int | None = None):
        """A request left (outputs.RequestOutput); times: its RequestTimes (stats.py), None for
        a request that never got into the engine's batch."""
        self.success.labels(self.model, out.finish_reason).inc()
        self.request_prompt.observe(len(out.prompt_token_ids))
        self.request_generation.observe(len(out.token_ids))
        if max_tokens is not None:
            self.request_max_tokens.observe(max_tokens)
        if times is None:
            return
        t = times
        self.e2e.observe(t.left - t.arrival)
        if t.scheduled is not None:
            self.queue_time.observe(t.scheduled - t.arrival)
            end = t.last if t.last is not None else t.left
            self.inference_time.observe(end - t.scheduled)
            if t.first is not None:
                self.prefill_time.observe(t.first - t.scheduled)
        if t.first is not None:
            self.decode_time.observe(t.last - t.first)
            if len(out.token_ids) > 1:
                self.tpot.observe((t.last - t.first) / (len(out.token_ids) - 1))

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry as the Accept header asks: OpenMetrics or Prometheus text."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
