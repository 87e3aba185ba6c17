"""/metrics under vLLM's names, against a live server: every series the Grafana dashboard
queries is exported; OpenMetrics by Accept; process series; per-token inter-token latency,
per-request times and token histograms add up to what the responses say; prefix-cache hits,
preemptions and KV-cache usage follow the engine; speculative counters only count rounds that
drafted."""
import asyncio
import json
import re
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark_rt.tools.serve import build_state  # noqa: E402
from tests.support.server import DRAFTER, MODEL, PROMPTS, TARGET, _Server  # noqa: E402
from tests.support.server import client, server  # noqa: E402, F401 (module fixtures)

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "dspark_rt.json"

VLLM_NAMES = [  # vllm/v1/metrics/loggers.py and spec_decode/metrics.py, prefix dspark_rt:
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
    "prompt_tokens_total", "generation_tokens_total", "request_success_total",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_params_max_tokens_bucket", "iteration_tokens_total_bucket",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "request_time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
    "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
    "request_decode_time_seconds_bucket", "request_inference_time_seconds_bucket",
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
]




def _samples(url) -> dict:
    """{(name, frozenset(labels other than model_name)): value} of every sample."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples, name, **labels) -> float:
    return samples.get((f"dspark_rt:{name}", frozenset(labels.items())), 0.0)


def test_vllm_names_openmetrics_and_process_series(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    names = {n for n, _ in _samples(server.url)}
    missing = [n for n in VLLM_NAMES if f"dspark_rt:{n}" not in names]
    assert not missing, missing
    assert "process_cpu_seconds_total" in names and "process_resident_memory_bytes" in names
    assert not any(n.startswith("dspark_rt:time_per_output_token") for n in names)  # old meaning
    om = httpx.get(server.url + "/metrics",
                   headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    plain = httpx.get(server.url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain") and "# EOF" not in plain.text


def _dashboard_series(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    found = {m for e in exprs for m in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+", e)}
    assert len(exprs) >= 20 and found
    return found


def test_dashboard_queries_only_exported_series(server, client):
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    exported = {n for n, _ in _samples(server.url)}
    dashboard = json.loads(DASHBOARD.read_text())
    unknown = sorted(_dashboard_series(dashboard) - exported)
    assert not unknown, f"the dashboard queries series the server does not export: {unknown}"
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Acceptance length", "Acceptance by position", "Drafts per step",
            "Share of rounds that drafted"} <= titles


def test_times_and_tokens_add_up(server, client):
    before = _samples(server.url)
    outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=10 + 3 * i,
                                      temperature=0, extra_body={"ignore_eos": True})
            for i, p in enumerate(PROMPTS[:4])]
    after = _samples(server.url)

    def d(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)
    n = [o.usage.completion_tokens for o in outs]
    prompts = sum(o.usage.prompt_tokens for o in outs)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert d(name + "_count") == len(outs), name
    assert d("request_time_per_output_token_seconds_count") == sum(k > 1 for k in n)
    # one inter-token latency per token after each request's first
    assert d("inter_token_latency_seconds_count") == sum(k - 1 for k in n)
    assert d("inter_token_latency_seconds_sum") == pytest.approx(
        d("request_decode_time_seconds_sum"), rel=1e-6, abs=1e-9)
    assert d("request_generation_tokens_sum") == d("generation_tokens_total") == sum(n)
    assert d("request_prompt_tokens_sum") == d("prompt_tokens_total") == prompts
    assert d("iteration_tokens_total_sum") == prompts + sum(n)
    assert d("request_params_max_tokens_sum") == sum(10 + 3 * i for i in range(4))
    assert _value(after, "kv_cache_usage_perc") == 0  # idle: cached pages are free pages


def test_prefix_cache_hits(server, client):
    bm = server.state.engine.target_blocks
    prompt = " ".join(f"word{i}" for i in range(40))
    ids = server.state.tokenizer.encode(prompt)
    assert len(ids) > 2 * bm.page_size
    before = _samples(server.url)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = _samples(server.url)
    assert _value(after, "prefix_cache_queries_total") - \
        _value(before, "prefix_cache_queries_total") == 2 * len(ids)
    # the second request finds every full page of the first's prompt but the last position's
    hits = _value(after, "prefix_cache_hits_total") - _value(before, "prefix_cache_hits_total")
    assert hits >= (len(ids) - 1) // bm.page_size * bm.page_size > 0


def test_spec_counters_count_only_rounds_that_drafted(server, client):
    before = _samples(server.url)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                  extra_body={"speculative": False, "ignore_eos": True})
    after = _samples(server.url)
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert _value(after, name) == _value(before, name), name
    rounds = _value(after, "spec_decode_num_rounds_total") - \
        _value(before, "spec_decode_num_rounds_total")
    assert rounds == r.model_extra["metrics"]["speculative_decoding"]["num_rounds"] == 11


def test_preemptions_are_counted():
    """A cache too small for four requests at once: the newest are preempted and recomputed."""
    state = build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=4, num_pages=12,
                        dtype="float32")
    srv = _Server(state)
    try:
        async def run():
            ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                    timeout=300)
            res = await asyncio.gather(*(ac.completions.create(
                model=MODEL, prompt=p, max_tokens=120, temperature=0,
                extra_body={"ignore_eos": True}) for p in PROMPTS[:4]))
            await ac.close()
            return res
        outs = asyncio.run(run())
        assert all(o.usage.completion_tokens == 120 for o in outs)
        s = _samples(srv.url)
        assert _value(s, "num_preemptions_total") == state.engine.scheduler.num_preemptions > 0
    finally:
        srv.stop()
