"""guidellm (a benchmark client nobody here wrote) against a live `dspark-rt serve` of the shipped
pair for a few seconds, offline: its default backend (openai_http, streamed chat completions,
which also sends `stream_options.continuous_usage_stats` and `ignore_eos`), synthetic prompts
made by the target's own tokenizer folder, a constant request rate. Its JSON report must show
successful requests and no errored one, every success of exactly the length it asked for, and
its counts must agree with what the server's /metrics counters say it served, speculative
counters included (drafts were verified and accepted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("guidellm")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark_rt.tools.serve import build_state  # noqa: E402
from tests.support.server import DRAFTER, MODEL, TARGET, _pages_back, _Server  # noqa: E402

PROMPT_TOKENS, OUTPUT_TOKENS = 32, 24
SECONDS = 4


def _counters(url) -> dict:
    """{name or name{finished_reason}: value} of the server's counters (model label dropped)."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total") and s.name.startswith("dspark_rt:"):
                reason = s.labels.get("finished_reason")
                key = s.name[len("dspark_rt:"):-len("_total")] + (f"{{{reason}}}" if reason else "")
                if "position" not in s.labels:
                    out[key] = s.value
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """guidellm's benchmark (its JSON report) and the server's counters' growth over the run."""
    state = build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=8, dtype="float32")
    srv = _Server(state)
    out = tmp_path_factory.mktemp("guidellm")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(out / "hf"),
                        "TOKENIZERS_PARALLELISM": "false"}
    report = out / "report.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={srv.url},model={MODEL}",
           "--profile", "kind=constant,rate=4,max_concurrency=4",
           "--constraint", f"kind=max_duration,seconds={SECONDS}",
           "--tokenizer", f"kind=hf_auto,model={TARGET}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                     f"output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={report}", "--disable-console"]
    try:
        before = _counters(srv.url)
        p = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"guidellm failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        assert _pages_back(state)  # requests it cancelled at the deadline were aborted
        after = _counters(srv.url)
    finally:
        srv.stop()
    (bench,) = json.loads(report.read_text())["benchmarks"]
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    return bench, grew


def test_requests_succeed_without_errors(run):
    bench, _ = run
    made = bench["scheduler_metrics"]["requests_made"]
    ok, errored = bench["requests"]["successful"], bench["requests"]["errored"] or []
    errors = [r["info"]["error"] for r in errored]
    assert made["errored"] == 0 and not errors, f"{made['errored']} errored: {errors[:3]}"
    assert len(ok) == made["successful"] > 0
    for r in ok:  # ignore_eos and max_completion_tokens honoured, usage reported
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r["output_metrics"]
        assert r["input_metrics"]["text_tokens"] >= PROMPT_TOKENS  # plus the chat template
        assert r["response_metrics"]["speculative_decoding"]["num_draft_tokens"] > 0


def test_token_counts_match_server_counters(run):
    """What guidellm counts is what the server says it served. Requests in flight at the
    deadline are cancelled by guidellm (incomplete) and aborted by the server: they bound the
    difference, and only they."""
    bench, grew = run
    ok = bench["requests"]["successful"]
    assert ok, "no successful request"
    cut = bench["scheduler_metrics"]["requests_made"]["incomplete"]
    length, aborted = grew.get("request_success{length}", 0), grew.get("request_success{abort}", 0)
    assert len(ok) <= length <= len(ok) + cut, (len(ok), length, cut)
    assert aborted <= cut and length + aborted == sum(v for k, v in grew.items()
                                                      if k.startswith("request_success{"))
    # every request that ran to its length emitted OUTPUT_TOKENS; an aborted one fewer
    spare = grew["generation_tokens"] - OUTPUT_TOKENS * length
    assert 0 <= spare <= (OUTPUT_TOKENS - 1) * aborted, (grew["generation_tokens"], length, aborted)
    assert sum(r["output_metrics"]["text_tokens"] for r in ok) <= grew["generation_tokens"]
    prompts = [r["input_metrics"]["text_tokens"] for r in ok]
    assert sum(prompts) <= grew["prompt_tokens"] <= max(prompts) * (len(ok) + cut)


def test_speculative_counters_moved(run):
    """Drafts were verified and accepted, and the per-request speculative metrics guidellm
    recorded from the responses add up to no more than the server's counters."""
    bench, grew = run
    ok = [r["response_metrics"]["speculative_decoding"] for r in bench["requests"]["successful"]]
    assert grew["spec_decode_num_drafts"] > 0 and grew["spec_decode_num_accepted_tokens"] > 0
    assert sum(m["num_draft_tokens"] for m in ok) <= grew["spec_decode_num_draft_tokens"]
    assert sum(m["num_accepted_draft_tokens"] for m in ok) <= grew["spec_decode_num_accepted_tokens"]
    assert sum(m["num_accepted_draft_tokens"] for m in ok) > 0
