"""`dspark-rt serve` when things go wrong: every error is the OpenAI error object naming the field
(huge numbers, out-of-vocabulary stop ids, unknown routes, oversized bodies), no filesystem path
reaches a client, a client that hangs up leaves no traceback in the log, and a dead engine or
tensor-parallel worker shows on /health and answers 503."""
import logging
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from dspark_rt.parallel import WorkerError  # noqa: E402
from dspark_rt.tools.serve import build_state  # noqa: E402
from tests.support.server import DRAFTER, MODEL, PROMPTS, TARGET, _pages_back, _Server  # noqa: E402

ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    srv = _Server(build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=4,
                              dtype="float32"))
    yield srv
    srv.stop()


def _post(server, body, path="completions", timeout=60):
    return httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=timeout)


def _openai_error(r, status, param=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == status, err
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    return err


@pytest.mark.parametrize("field", ["temperature", "top_p", "seed"])  # top_k, max_tokens: capped
def test_huge_integers_name_the_field(server, field):
    _openai_error(_post(server, {"prompt": "x", field: 10**400}), 400, field)


def test_out_of_vocabulary_stop_token_ids_name_the_field(server):
    _openai_error(_post(server, {"prompt": "x", "stop_token_ids": [10**6]}), 400, "stop_token_ids")


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404), ("POST", "/v1/nope", 404), ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_are_openai_errors(server, method, path, status):
    _openai_error(httpx.request(method, server.url + path), status)


def test_a_server_bug_is_a_500_openai_error_without_details(server, monkeypatch):
    async def submit(prompt, params):
        raise RuntimeError("secret detail at /opt/models/x")
    monkeypatch.setattr(server.state.loop, "submit", submit)
    err = _openai_error(_post(server, {"prompt": "x"}), 500)
    assert "secret" not in err["message"] and "/opt" not in err["message"]


def test_refused_chat_role_shows_no_path(server):
    from pathlib import Path
    err = _openai_error(_post(server, {"messages": [{"role": "bogus", "content": "hi"}]},
                              "chat/completions"), 400, "messages")
    assert "bogus" in err["message"]  # the template's own words stay
    for leak in (TARGET, str(Path(TARGET).resolve()), "tokenizer_config", "Traceback", "/"):
        assert leak not in err["message"], err


def test_body_over_the_limit_is_413(server):
    state = server.state
    old, state.max_body_bytes = state.max_body_bytes, 2000
    try:
        big = {"prompt": "x" * 3000, "max_tokens": 1}
        _openai_error(_post(server, big), 413)
        # no Content-Length (chunked): counted while reading
        raw = httpx.post(server.url + "/v1/completions", timeout=60,
                         content=(b"x" * 500 for _ in range(10)),
                         headers={"content-type": "application/json"})
        assert "content-length" not in raw.request.headers
        _openai_error(raw, 413)
        assert _post(server, {"prompt": "x" * 100, "max_tokens": 1}).status_code == 200
    finally:
        state.max_body_bytes = old


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_whole_response_disconnect_is_quiet(server):
    """A non-streamed request given up on: aborted, pages back, and nothing logged as an error."""
    seen = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "dspark_rt.server.engine_loop")]
    for lg in loggers:
        lg.addHandler(seen)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            _post(server, body, timeout=httpx.Timeout(60, read=0.5))
        assert _pages_back(server.state), "an abandoned request kept its pages"
        time.sleep(0.5)  # the handler finishes after the abort
    finally:
        for lg in loggers:
            lg.removeHandler(seen)
    bad = [r.getMessage() for r in seen.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, bad


# -- a dead engine ---------------------------------------------------------------------------

@pytest.fixture
def own_server():
    srv = _Server(build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=4,
                              dtype="float32"))
    yield srv
    srv.stop()


def _is_down(server, match):
    h = httpx.get(server.url + "/health", timeout=10)
    assert match in _openai_error(h, 503)["message"]
    r = _post(server, {"prompt": "x", "max_tokens": 2}, timeout=10)
    assert match in _openai_error(r, 503)["message"]


def test_worker_error_takes_the_server_down(own_server):
    eng = own_server.state.engine

    def step():
        raise WorkerError("tensor-parallel worker rank 1 (pid 4242) exited with code -9; the "
                          "group is shut down")
    eng.step = step
    r = _post(own_server, {"prompt": "x", "max_tokens": 2})  # in flight when the worker died
    assert "rank 1" in _openai_error(r, 503)["message"]
    _is_down(own_server, "rank 1")


def test_dead_engine_thread_takes_the_server_down(own_server):
    eng = own_server.state.engine

    def broken():
        raise RuntimeError("boom")
    eng.has_unfinished = broken
    r = _post(own_server, {"prompt": "x", "max_tokens": 2}, timeout=10)  # wakes it: it dies
    assert "engine" in _openai_error(r, 503)["message"]
    _is_down(own_server, "engine")


def test_killed_tensor_parallel_worker_takes_the_server_down(tiny_target, tiny_drafters):
    """A real 2-rank CPU group: a worker killed while the server idles shows on /health at once,
    and requests get 503 naming it instead of a 500 each, forever."""
    from tests.support.tp_support import stop_all
    stop_all()
    state = build_state(tiny_target, tiny_drafters("vanilla", 4), mode="dspark", dtype="float64",
                        served_model_name=MODEL, max_num_seqs=2, tensor_parallel_size=2)
    tp = state.engine.runner.tensor_parallel
    srv = _Server(state)
    try:
        r = _post(srv, {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert httpx.get(srv.url + "/health").status_code == 200
        tp.procs[0].kill()
        tp.procs[0].wait()
        _is_down(srv, "rank 1")
    finally:
        srv.stop()
        tp.shutdown()
