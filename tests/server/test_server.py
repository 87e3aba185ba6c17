"""`dspark-rt serve` against a live server on 127.0.0.1 (uvicorn in a thread of this process),
driven by the real `openai` client and plain httpx: greedy text equals Decoder.generate, a stream
equals the whole response, chat, per-request metrics reconcile with the Prometheus counters,
OpenAI errors, disconnects free their pages, and a bounded load test."""
import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dspark_rt import Decoder, SamplingParams  # noqa: E402
from dspark_rt.tools.serve import build_state  # noqa: E402
from tests.support.server import (DRAFTER, MODEL, PROMPTS, TARGET, _free_port, _pages_back,  # noqa: E402
                                  _Server)


@pytest.fixture(scope="module")
def server():
    state = build_state(TARGET, DRAFTER, served_model_name=MODEL, max_num_seqs=32, dtype="float32")
    srv = _Server(state)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    """A Decoder of its own (generate would resize the server's Engine, which owns the caches)."""
    return Decoder.from_pretrained(TARGET, DRAFTER, dtype="float32")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _greedy(**kw):
    return dict(temperature=0, **kw)


def _metrics(server) -> dict:
    """{(name, frozenset(labels)): value} of the dspark_rt: samples."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("dspark_rt:")}


def _spec(obj) -> dict:
    extra = obj.model_extra if hasattr(obj, "model_extra") else obj
    return extra["metrics"]["speculative_decoding"]


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_text_equals_decoder_generate(client, ref):
    for p in PROMPTS[:4]:
        want = ref.generate([p], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        got = client.completions.create(model=MODEL, prompt=p, **_greedy(max_tokens=24))
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        m = _spec(got)
        assert m["num_rounds"] == want.metrics.num_rounds
        assert m["num_spec_steps"] == want.metrics.verified_by_position[0]  # rounds that drafted
        assert m["num_accepted_draft_tokens"] == want.metrics.num_accepted_tokens
        # the per-request switch: no drafts verified, the same greedy text
        plain = client.completions.create(model=MODEL, prompt=p, extra_body={"speculative": False},
                                          **_greedy(max_tokens=24))
        assert plain.choices[0].text == want.text
        assert _spec(plain)["num_draft_tokens"] == 0 and _spec(plain)["mean_acceptance_length"] == 1.0
        assert _spec(plain)["num_spec_steps"] == 0 < _spec(plain)["num_rounds"]
    # token-id prompts too
    ids = ref.tokenizer.encode(PROMPTS[0])
    got = client.completions.create(model=MODEL, prompt=ids, **_greedy(max_tokens=8))
    want = ref.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert got.choices[0].text == want.text


def _stream_text(stream):
    text, finishes, last = [], [], None
    for c in stream:
        last = c
        for ch in c.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            text.append(piece)
            if ch.finish_reason is not None:
                finishes.append(ch.finish_reason)
    return "".join(text), finishes, last


@pytest.mark.parametrize("kw", [
    _greedy(max_tokens=40),
    _greedy(max_tokens=40, stop=["\n    ", "self"]),           # stop strings: held-back text
    dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=30),    # seeded sampling
    _greedy(max_tokens=20, logprobs=0),
])
def test_stream_equals_whole(server, client, kw):
    for p in PROMPTS[:3]:
        whole = client.completions.create(model=MODEL, prompt=p, **kw)
        text, finishes, last = _stream_text(client.completions.create(
            model=MODEL, prompt=p, stream=True, stream_options={"include_usage": True}, **kw))
        assert text == whole.choices[0].text
        assert finishes == [whole.choices[0].finish_reason]
        assert last.choices == [] and last.usage == whole.usage  # the usage chunk comes last
        assert _spec(last) == _spec(whole)
    if "logprobs" in kw:  # the streamed log-probabilities add up to the whole response's
        raw = httpx.post(server.url + "/v1/completions", json=dict(
            model=MODEL, prompt=PROMPTS[0], stream=True, **kw), timeout=60).text
        chunks = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith("data: {")]
        streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
        whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], **kw)
        assert streamed == whole.choices[0].logprobs.token_logprobs
        assert len(streamed) == whole.usage.completion_tokens
        # without include_usage the metrics ride on the finishing chunk
        assert chunks[-1]["choices"][0]["finish_reason"] and "metrics" in chunks[-1]


def test_stop_string_across_steps_is_never_streamed(client):
    """A stop string whose first characters arrive one step before its last: the stream must not
    have sent them (the hold-back), so stream and whole response still agree."""
    kw = _greedy(max_tokens=48, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], stream=True, **kw) if c.choices[0].text]
    full, b, tried = "".join(pieces), 0, 0
    for piece in pieces[:-1]:  # without stop strings a chunk is one step's text
        b += len(piece)
        stop = full[b - 2 : b + 2]
        if len(stop) == 4 and stop.strip() and full.find(stop) == b - 2:
            tried += 1
            whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], stop=[stop], **kw)
            assert whole.choices[0].text == full[: b - 2]
            text, finishes, _ = _stream_text(client.completions.create(
                model=MODEL, prompt=PROMPTS[1], stop=[stop], stream=True, **kw))
            assert text == whole.choices[0].text and finishes == ["stop"]
            if tried == 3:
                break
    assert tried, f"no step boundary to put a stop string on in {pieces}"


def test_chat(client, ref):
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Sort a list."}]
    want = ref.chat(msgs, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=msgs, **_greedy(max_tokens=24))
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    text, finishes, last = _stream_text(client.chat.completions.create(
        model=MODEL, messages=msgs, stream=True, stream_options={"include_usage": True},
        **_greedy(max_tokens=24)))
    assert text == want.text and finishes == [got.choices[0].finish_reason]
    assert _spec(last) == _spec(got)
    lp = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=0,
                                        **_greedy(max_tokens=6))
    assert len(lp.choices[0].logprobs.content) == 6
    assert all(t.logprob <= 0 for t in lp.choices[0].logprobs.content)


def test_per_request_metrics_reconcile_with_counters(server, client):
    before = _metrics(server)
    outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=20 + 3 * i, temperature=0,
                                      extra_body={"speculative": i % 3 != 2})
            for i, p in enumerate(PROMPTS)]
    last = None
    for last in client.chat.completions.create(  # a streamed one: its usage chunk
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
            temperature=0, stream=True, stream_options={"include_usage": True}):
        pass
    specs = [_spec(o) for o in outs] + [_spec(last)]
    after = _metrics(server)

    def delta(name, **labels):
        key = (f"dspark_rt:{name}", frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("spec_decode_num_drafts_total") == sum(s["num_spec_steps"] for s in specs)
    assert delta("spec_decode_num_rounds_total") == sum(s["num_rounds"] for s in specs)
    # plain requests add rounds, never drafts (nor draft tokens)
    plain = [s for i, s in enumerate(specs[:-1]) if i % 3 == 2]
    assert plain and all(s["num_spec_steps"] == s["num_draft_tokens"] == 0 < s["num_rounds"]
                         for s in plain)
    assert delta("spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    assert delta("spec_decode_num_accepted_tokens_total") == \
        sum(s["num_accepted_draft_tokens"] for s in specs)
    for k in range(len(specs[0]["num_accepted_tokens_per_pos"])):
        assert delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) == \
            sum(s["num_accepted_tokens_per_pos"][k] for s in specs)
    for s in specs:  # each request's numbers agree with themselves
        assert sum(s["acceptance_histogram"]) == s["num_rounds"]
        assert sum(i * n for i, n in enumerate(s["acceptance_histogram"])) == \
            s["num_accepted_draft_tokens"]
    assert delta("generation_tokens_total") == \
        sum(o.usage.completion_tokens for o in outs) + last.usage.completion_tokens
    assert delta("time_to_first_token_seconds_count") == len(specs)
    assert delta("e2e_request_latency_seconds_count") == len(specs)
    assert sum(delta("request_success_total", finished_reason=r) for r in ("stop", "length")) == len(specs)
    assert after[("dspark_rt:num_requests_running", frozenset())] == 0


@pytest.mark.parametrize("path,body,status,param", [
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 10**7]}, 400, "prompt"),
    ("completions", {"prompt": "x " * 2000}, 400, "prompt"),  # longer than the context
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "x", "speculative": "yes"}, 400, "speculative"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21,
                          "logprobs": True}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_errors_name_the_field(server, path, body, status, param):
    r = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and param in err["message"]


def test_errors_through_the_client_and_bad_json(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_queue_full_is_503_with_retry_after(server, client):
    loop = server.state.loop
    old, loop.max_waiting = loop.max_waiting, 0
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    finally:
        loop.max_waiting = old
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == 503
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_bad_request_does_not_disturb_others(server, client):
    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        good = [ac.completions.create(model=MODEL, prompt=p, **_greedy(max_tokens=16)) for p in PROMPTS[:3]]
        bad = [ac.completions.create(model=MODEL, prompt="x", temperature=-1),
               ac.completions.create(model=MODEL, prompt=[1, 10**7])]
        res = await asyncio.gather(*good, *bad, return_exceptions=True)
        await ac.close()
        return res
    alone = [client.completions.create(model=MODEL, prompt=p, **_greedy(max_tokens=16)).choices[0].text
             for p in PROMPTS[:3]]
    res = asyncio.run(run())
    assert [r.choices[0].text for r in res[:3]] == alone
    assert all(isinstance(r, openai.BadRequestError) for r in res[3:])


def _counter(server, reason):
    return _metrics(server).get(("dspark_rt:request_success_total",
                                 frozenset({("finished_reason", reason)})), 0.0)


def test_disconnect_aborts_and_frees_pages(server):
    aborted = _counter(server, "abort")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    # a stream read for two chunks, then dropped
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
            it = r.iter_lines()
            got = [next(it) for _ in range(3)]
            assert got[0].startswith("data: {")
    # a whole response given up on before it is ready
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    assert _pages_back(server.state), "an abandoned request kept its pages"
    t0 = time.monotonic()
    while _counter(server, "abort") < aborted + 2 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert _counter(server, "abort") == aborted + 2


def _load(server, jobs, concurrency, drop=()):
    """Streams every job (completion kwargs) with at most `concurrency` in flight; returns per job
    (text, finish reasons seen, usage chunk count). Jobs whose index is in `drop` hang up after
    their first chunk."""
    async def one(ac, sem, i, kw):
        async with sem:
            text, finishes, usages = [], [], 0
            stream = await ac.completions.create(model=MODEL, stream=True,
                                                 stream_options={"include_usage": True}, **kw)
            async for c in stream:
                if i in drop:
                    await stream.close()
                    return None
                usages += c.usage is not None
                for ch in c.choices:
                    text.append(ch.text)
                    if ch.finish_reason is not None:
                        finishes.append(ch.finish_reason)
            return "".join(text), finishes, usages

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                timeout=600)  # the client pools up to 1000 connections
        sem = asyncio.Semaphore(concurrency)
        res = await asyncio.gather(*(one(ac, sem, i, kw) for i, kw in enumerate(jobs)))
        await ac.close()
        return res
    return asyncio.run(run())


def _jobs(n):
    """n requests over a few distinct ones: greedy and seeded-sampled, of several lengths."""
    kinds = []
    for i, p in enumerate(PROMPTS):
        kinds.append(dict(prompt=p, max_tokens=8 + 4 * (i % 5), temperature=0))
        kinds.append(dict(prompt=p, max_tokens=12, temperature=0.9, seed=i,
                          extra_body={"ignore_eos": True}))
    return [kinds[i % len(kinds)] for i in range(n)], kinds


@pytest.mark.parametrize("n", [pytest.param(300, marks=pytest.mark.slow)])
def test_load_each_request_finishes_once_equal_to_alone(server, client, n):
    jobs, kinds = _jobs(n)
    alone = {json.dumps(k, sort_keys=True): client.completions.create(model=MODEL, **k).choices[0].text
             for k in kinds}
    drop = set(range(5, n, 10))  # clients that hang up mid-stream disturb nobody
    aborted, done = _counter(server, "abort"), _counter(server, "stop") + _counter(server, "length")
    # all at once: most wait for one of the 32 batch slots
    res = _load(server, jobs, concurrency=n, drop=drop)
    for i, (kw, r) in enumerate(zip(jobs, res)):
        if i in drop:
            continue
        text, finishes, usages = r
        assert len(finishes) == 1 and usages == 1  # finished exactly once
        assert text == alone[json.dumps(kw, sort_keys=True)]
    assert _pages_back(server.state), "pages still held after the load"
    # a hung-up request is aborted, unless it had finished before the server saw the hang-up
    left = _counter(server, "abort") - aborted
    assert 0 < left <= len(drop)
    # and every request left the engine exactly once
    assert _counter(server, "stop") + _counter(server, "length") - done + left == n


def test_serve_command(tmp_path):
    """`python -m dspark_rt serve` as users start it: up, answers, and shuts down on SIGTERM."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "dspark_rt", "serve", "--target", TARGET, "--drafter", DRAFTER,
           "--port", str(port), "--served-model-name", MODEL, "--max-num-seqs", "4",
           "--log-level", "info", "--policy", "threshold"]
    bad = subprocess.run(cmd[:4] + ["--target", str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "not a model folder" in bad.stderr
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stderr=log)
    try:
        url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
        while True:
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() - t0 < 120, "the server did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4 and "dspark_rt:spec_decode" in httpx.get(url + "/metrics").text
    finally:
        proc.terminate()  # uvicorn shuts down, then re-raises the signal it caught
        assert proc.wait(60) in (0, -15)
        log.close()
    # the startup summary names what was loaded and where it listens
    startup = [line for line in (tmp_path / "server.log").read_text().splitlines()
               if f"serving '{MODEL}'" in line]
    assert len(startup) == 1 and f"listening on http://127.0.0.1:{port}" in startup[0]
    assert "mode dspark, policy threshold" in startup[0] and "KV cache" in startup[0]
