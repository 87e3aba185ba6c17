"""Completions' `echo` and the prompt's log-probabilities against a live server, driven by the
`openai` client: the prompt tokens' log-probabilities equal a fresh full forward's log_softmax
(the target's raw distribution), in OpenAI's legacy shape (what lm-eval's `local-completions`
reads) and vLLM's `prompt_logprobs` field; `max_tokens: 0` scores the prompt alone; a stream
adds up to the whole response; what cannot be honoured is refused by name."""
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import torch  # noqa: E402

from dspark_rt import Decoder, SamplingParams  # noqa: E402
from tests.support.helpers import full_forward_logits  # noqa: E402
from tests.support.server import DRAFTER, MODEL, PROMPTS, TARGET, _pages_back  # noqa: E402
from tests.support.server import client, server  # noqa: E402, F401 (module fixtures)




@pytest.fixture(scope="module")
def ref():
    return Decoder.from_pretrained(TARGET, DRAFTER, dtype="float32")


def _full_lp(ref, ids):
    """log_softmax of one fresh forward over ids [len, V], float64."""
    return torch.log_softmax(full_forward_logits(ref.runner.target, ids).double(), dim=-1)


def _piece(ref, t):
    return ref.tokenizer.decode([t])


@pytest.mark.parametrize("n", [0, 1, 5])
def test_score_only_equals_full_forward(client, ref, n):
    """echo + max_tokens 0 + logprobs n: the prompt alone, its tokens' log-probabilities exact."""
    for prompt in PROMPTS[:3]:
        ids = ref.tokenizer.encode(prompt)
        lp = _full_lp(ref, ids)
        got = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0,
                                        logprobs=n, temperature=0)
        c = got.choices[0]
        assert c.text == prompt and c.finish_reason == "length"
        assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
        want = [None] + [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
        assert c.logprobs.token_logprobs == want
        assert c.logprobs.tokens == [_piece(ref, t) for t in ids]
        offs = [sum(len(_piece(ref, t)) for t in ids[:i]) for i in range(len(ids))]
        assert c.logprobs.text_offset == offs
        assert c.logprobs.top_logprobs[0] is None
        for p in range(1, len(ids)):
            top = c.logprobs.top_logprobs[p]
            vals, tids = lp[p - 1].topk(n)
            expect = {_piece(ref, ids[p]): want[p]}
            expect.update({_piece(ref, t): v for t, v in zip(tids.tolist(), vals.tolist())})
            assert top == expect, f"position {p}"


def test_lm_eval_request(client, ref):
    """What lm-eval's local-completions sends for a log-likelihood request: echo, max_tokens 1,
    logprobs 1, temperature 0, a batch of one token-id prompt; it reads token_logprobs[ctx:-1]
    and compares each with max(top_logprobs[i].values()) (is_greedy)."""
    ids = ref.tokenizer.encode(PROMPTS[1])
    r = httpx.post(f"{client.base_url}completions", json={
        "model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    gen = ref.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=True),
                       use_tqdm=False)[0]
    lp = _full_lp(ref, ids)
    lps = c["logprobs"]["token_logprobs"]
    assert lps[:-1] == [None] + [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert lps[-1] == gen.logprobs[0]  # the generated token's, then
    assert c["text"] == ref.tokenizer.decode(ids) + gen.text
    tops = c["logprobs"]["top_logprobs"]
    # the generated token's alternatives: itself and its row's top 1 (greedy: the same token)
    assert tops[-1] == {ref.tokenizer.decode([gen.token_ids[0]]): gen.logprobs[0]}
    greedy = [lps[p] == max(tops[p].values()) for p in range(1, len(ids))]
    assert greedy == [ids[p] == lp[p - 1].argmax().item() for p in range(1, len(ids))]


def test_echo_with_generation_and_stream(client, ref):
    prompt = PROMPTS[2]
    gen = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=True),
                       use_tqdm=False)[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=12,
                                      logprobs=2, temperature=0)
    c = whole.choices[0]
    P = len(gen.prompt_token_ids)
    assert c.text == prompt + gen.text
    assert c.logprobs.token_logprobs[P:] == gen.logprobs
    assert c.logprobs.text_offset[P] == len(prompt)
    assert whole.usage.completion_tokens == len(gen.token_ids)
    plain = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=12,
                                      temperature=0)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=12,
                                            logprobs=2, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for x in getattr(ch.choices[0].logprobs, key)]
        assert streamed == getattr(c.logprobs, key), key
    # scoring, streamed: the prompt's chunk, then the finish reason
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0,
                                            logprobs=0, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt
    assert chunks[-1].choices[0].finish_reason == "length"


def test_token_id_prompt_echoes_its_text(client, ref):
    ids = ref.tokenizer.encode(PROMPTS[3])
    got = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, temperature=0)
    assert got.choices[0].text == ref.tokenizer.decode(ids)


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_vllm_prompt_logprobs_field(server, ref, kind):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    if kind == "chat/completions":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = PROMPTS[0]
    r = httpx.post(f"{server.url}/v1/{kind}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    got = out["prompt_logprobs"] if kind == "chat/completions" else out["choices"][0]["prompt_logprobs"]
    if kind == "chat/completions":
        ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True))
    else:
        ids = ref.tokenizer.encode(PROMPTS[0])
    lp = _full_lp(ref, ids)
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row = lp[p - 1]
        entry = got[p]
        assert entry[str(ids[p])]["logprob"] == row[ids[p]].item()
        assert entry[str(ids[p])]["decoded_token"] == _piece(ref, ids[p])
        vals, tids = row.topk(2)
        assert set(entry) == {str(ids[p])} | {str(t) for t in tids.tolist()}
        for t, v in zip(tids.tolist(), vals.tolist()):
            assert entry[str(t)]["logprob"] == v
            assert entry[str(t)]["rank"] == 1 + (row > v).sum().item()
        rank = entry[str(ids[p])]["rank"]
        assert rank is None or rank == 1 + (row > row[ids[p]]).sum().item()


def test_both_fields_cut_to_their_own_n(server, ref):
    """echo's logprobs 1 and prompt_logprobs 4 in one request: the engine computes the top 4
    once; the legacy entries keep the prompt token and the top 1, the vLLM field the top 4."""
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[4], "echo": True, "logprobs": 1, "prompt_logprobs": 4,
        "max_tokens": 0, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    ids = ref.tokenizer.encode(PROMPTS[4])
    lp = _full_lp(ref, ids)
    for p in range(1, len(ids)):
        best = lp[p - 1].argmax().item()
        assert c["logprobs"]["top_logprobs"][p] == {_piece(ref, ids[p]): lp[p - 1, ids[p]].item(),
                                                    _piece(ref, best): lp[p - 1, best].item()}
        assert set(c["prompt_logprobs"][p]) == {str(ids[p])} | {
            str(t) for t in lp[p - 1].topk(4).indices.tolist()}


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "logprobs": 21}, "logprobs", ["at most 20"]),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ["echo"]),
    ({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens",
     ["echo"]),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs", ["at most 20"]),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs", [">= 0"]),
    ({"prompt": "x", "echo": "yes"}, "echo", ["true or false"]),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo", ["not served yet"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", [">= 1"]),
])
def test_refused_by_name(server, body, param, words):
    path = "chat/completions" if "messages" in body else "completions"
    r = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def test_pages_back(server):
    assert _pages_back(server.state)
