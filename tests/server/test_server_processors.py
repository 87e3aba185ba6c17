"""The logits-processor fields (min_p, min_tokens, allowed_token_ids, bad_words) and the
generated tokens' top log-probabilities (completions' logprobs N, chat's top_logprobs), served
through the real `openai` client by a live speculative server, against plain decoding of the
same target by the Python API (float32; greedy is bit-equal there)."""
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from dspark_rt import Decoder, SamplingParams  # noqa: E402
from tests.support.server import MODEL, PROMPTS, TARGET  # noqa: E402
from tests.support.server import client, server  # noqa: E402, F401 (module fixtures)

N = 16
MSGS = [{"role": "user", "content": "Sort a list."}]




@pytest.fixture(scope="module")
def ref():
    return Decoder.from_pretrained(TARGET, mode="ar", dtype="float32")


def _fields(ref, prompt):
    """Per field, a request that changes greedy plain decoding of prompt (the request's extra
    fields, and the SamplingParams that plain decoding runs them with)."""
    tok = ref.engine.processor.tokenizer
    ids = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    word = next(tok.decode(ids[i:i + 2]) for i in range(1, N - 1)
                if tok.encode(tok.decode(ids[i:i + 2]).lstrip(), add_special_tokens=False) == ids[i:i + 2])
    V = ref.target.config.vocab_size
    return {
        # min_p 1 keeps the most likely token alone: sampled output is greedy output
        "min_p": dict(min_p=1.0, temperature=1.0, seed=3),
        "allowed_token_ids": dict(allowed_token_ids=[t for t in range(V) if t != ids[0]]),
        "bad_words": dict(bad_words=[word]),
        "min_tokens": dict(min_tokens=10, stop_token_ids=[ids[1]], ignore_eos=False),
    }


def _params(kw):
    kw = {"temperature": 0, "max_tokens": N, "ignore_eos": True, **kw}
    return SamplingParams(**kw)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["min_p", "allowed_token_ids", "bad_words", "min_tokens"])
def test_processor_fields_are_served(client, ref, field, stream):
    prompt = PROMPTS[0]
    kw = _fields(ref, prompt)[field]
    want = ref.generate([prompt], _params(kw), use_tqdm=False)[0].text
    if field != "min_p":
        assert want != ref.generate([prompt], _params({}), use_tqdm=False)[0].text, field
    body = {"temperature": 0, "max_tokens": N, "ignore_eos": True, **kw}
    extra = {k: v for k, v in body.items() if k not in ("temperature", "max_tokens", "seed")}
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=body["temperature"],
                                  max_tokens=N, seed=body.get("seed"), stream=stream, extra_body=extra)
    text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert text == want, field
    # chat: the same fields through the chat template
    chat_prompt = ref.engine.processor.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True)
    kw = _fields(ref, chat_prompt)[field]
    body = {"temperature": 0, "max_tokens": N, "ignore_eos": True, **kw}
    extra = {k: v for k, v in body.items() if k not in ("temperature", "max_tokens", "seed")}
    want = ref.generate([chat_prompt], _params(kw), use_tqdm=False)[0].text
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=body["temperature"],
                                       max_tokens=N, seed=body.get("seed"), stream=stream,
                                       extra_body=extra)
    text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream \
        else r.choices[0].message.content
    assert text == want, field


@pytest.mark.parametrize("extra,param", [
    ({"min_p": 1.5}, "min_p"), ({"min_p": "x"}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 10 ** 7]}, "allowed_token_ids"),
    ({"allowed_token_ids": "1"}, "allowed_token_ids"),
    ({"bad_words": "def"}, "bad_words"), ({"bad_words": [" "]}, "bad_words"),
])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_bad_processor_values_name_the_field(server, extra, param, path):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body |= {"messages": MSGS} if path.startswith("chat") else {"prompt": "x"}
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def _ref_tops(ref, prompt, n):
    """Greedy plain decoding's tokens and, per token, its row's top n (id, logprob)."""
    o = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                              logprobs=n), use_tqdm=False)[0]
    tops = [sorted(d.items(), key=lambda kv: kv[1].rank)[:n] for d in o.outputs[0].logprobs]
    return o.token_ids, [[(t, v.logprob) for t, v in top] for top in tops]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_n_gives_top_alternatives(client, ref, stream):
    tok = ref.engine.processor.tokenizer
    piece = lambda t: tok.decode([t])  # noqa: E731
    ids, tops = _ref_tops(ref, PROMPTS[1], 3)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=N,
                                  logprobs=3, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        got = [e for c in r if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.top_logprobs]
    else:
        got = r.choices[0].logprobs.top_logprobs
    assert len(got) == N
    for i, (t, top) in enumerate(zip(ids, tops)):
        want = {piece(a): b for a, b in top}
        assert set(got[i]) == set(want) | {piece(t)}, i
        for k, v in want.items():
            assert got[i][k] == pytest.approx(v, abs=1e-5), (i, k)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs(client, ref, stream):
    tok = ref.engine.processor.tokenizer
    prompt = tok.apply_chat_template(MSGS, add_generation_prompt=True)
    ids, tops = _ref_tops(ref, prompt, 4)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=N,
                                       logprobs=True, top_logprobs=4, stream=stream,
                                       extra_body={"ignore_eos": True})
    if stream:
        content = [e for c in r if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
    else:
        content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in ids]
    for e, top in zip(content, tops):
        assert [x.token for x in e.top_logprobs] == [tok.decode([a]) for a, _ in top]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx([b for _, b in top], abs=1e-5)
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)  # greedy: the top
