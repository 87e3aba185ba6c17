"""server/responses.py: the streamed text of a response adds up to its whole text, with the
shipped tokenizer (dspark_rt/pretrained/target), special tokens mid-output included."""
from importlib.resources import files

import pytest

from dspark_rt import SamplingParams
from dspark_rt.checkpoint.tokenizer import Tokenizer
from dspark_rt.engine.processing import Processor
from dspark_rt.server.responses import Body

TARGET = str(files("dspark_rt") / "pretrained" / "target")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TARGET)


def _whole_and_streamed(tok, ids, params, kind, chunk):
    """The engine's output for `ids` (Processor.commit / output, the whole-response path) and
    the text its stream chunks carry, `chunk` tokens per step."""
    proc = Processor(tok, vocab_size=tok.vocab_size, max_model_len=4096,
                     eos_token_ids=tok.eos_token_ids, gamma=1)
    req = proc.request(0, [1, 2], params, request_id=0, seed=0, stream=0)
    proc.commit(req, list(ids), None)
    out = proc.output(req)
    body = Body(kind, "tiny", tok, False, params.stop, params.skip_special_tokens)
    pieces = []
    for i in range(0, len(out.token_ids), chunk):
        c = body.delta(out.token_ids[i : i + chunk], None)
        if c is not None:
            pieces.append(c["choices"][0])
    pieces.append(body.last([], None, out)["choices"][0])
    text = "".join(p["text"] if kind == "completion" else p["delta"]["content"] for p in pieces)
    whole = body.full(out)["choices"][0]
    return out, text, whole["text"] if kind == "completion" else whole["message"]["content"]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("stop", [[], ["never there"]])
@pytest.mark.parametrize("kind,chunk", [("completion", 1), ("chat", 3)])
def test_stream_equals_whole_text_with_a_special_token_mid_output(tok, skip, stop, kind, chunk):
    eot = tok.token_to_id("<|endoftext|>")
    ids = (tok.encode("def f(x):", add_special_tokens=False) + [eot]
           + tok.encode("\n    return x + 1", add_special_tokens=False))
    params = SamplingParams(max_tokens=64, ignore_eos=True, stop=stop, skip_special_tokens=skip)
    out, streamed, whole = _whole_and_streamed(tok, ids, params, kind, chunk)
    assert out.token_ids == ids
    assert ("<|endoftext|>" in out.text) is not skip
    assert out.text.endswith("return x + 1")
    assert streamed == whole == out.text
