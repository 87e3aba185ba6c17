"""A server that talks: the startup summary, the periodic stats line, /tokenize, /detokenize and
/version in vLLM's shapes, and `--policy` taking every policy the Python API takes."""
import logging
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import dspark_rt  # noqa: E402
from dspark_rt.policies import POLICIES  # noqa: E402
from dspark_rt.tools import serve  # noqa: E402
from tests.support.server import DRAFTER, MODEL, PROMPTS, TARGET, _Server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    srv = _Server(serve.build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=4,
                                    dtype="float32", log_stats_interval=0.2))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_every_policy_is_a_choice():
    for name in POLICIES:
        assert serve.parser().parse_args(["--target", TARGET, "--policy", name]).policy == name
    a = serve.parser().parse_args(["--target", TARGET])
    assert a.log_stats_interval == 10.0
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            serve.parser().parse_args(["--target", TARGET, "--log-stats-interval", bad])


def test_startup_summary(server):
    s = server.state.summary
    eng = server.state.engine
    for part in (f"serving '{MODEL}'", f"target {TARGET}", "float32", f"drafter {DRAFTER}",
                 "mode dspark", "policy fixed", "calibration ", "dspark_calibration.json",
                 f"KV cache {eng.num_pages} pages of {eng.runner.page_size} tokens"):
        assert part in s, (part, s)


def test_stats_line(server, client, caplog):
    with caplog.at_level(logging.INFO, logger="dspark_rt.server"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            lines = [r.getMessage() for r in caplog.records if "generation throughput" in
                     r.getMessage() and r.levelno == logging.INFO]
            if lines:
                break
            time.sleep(0.05)
    assert lines, "no stats line"
    line = lines[0]
    for part in ("prompt throughput", "tokens/s", "running", "waiting", "KV cache usage",
                 "acceptance length"):
        assert part in line, line


def test_tokenize_detokenize_version(server, client):
    url, tok = server.url, server.state.tokenizer
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[1]}).json()
    done = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1)
    assert r["tokens"] == tok.encode(PROMPTS[1]) and r["count"] == done.usage.prompt_tokens
    assert r["max_model_len"] == server.state.max_model_len and r["token_strs"] is None
    strs = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[1],
                                               "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == PROMPTS[1]
    msgs = [{"role": "user", "content": "hello"}]
    chat = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
    assert chat["count"] == client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPTS[1]}
    assert httpx.get(url + "/version").json() == {"version": dspark_rt.__version__}
    for path, body, param in [("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [1], "model": "other"}, "model")]:
        e = httpx.post(url + path, json=body)
        assert e.status_code in (400, 404) and e.json()["error"]["param"] == param, e.text
