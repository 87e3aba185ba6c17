"""Structured output over HTTP, through the real `openai` client: every way of asking (OpenAI's
response_format, vLLM's structured_outputs and guided_*) on both endpoints, streamed or whole,
gives text that parses under its grammar and equals what the Python API decodes under the same
StructuredOutputsParams; a bad grammar, an unknown form or two ways at once is a 400 naming the
field, before any work."""
import json
import re
import threading

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from dspark_rt import Decoder, SamplingParams  # noqa: E402
from dspark_rt.structured import StructuredOutputsParams  # noqa: E402
from tests.support.server import DRAFTER, MODEL, PROMPTS, TARGET  # noqa: E402
from tests.support.server import client, server  # noqa: E402, F401 (module fixtures)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"def [a-z_]{1,8}\(\):"
CHOICES = ["yes", "no", "maybe"]




def _complete(client, stream, extra, prompt=PROMPTS[0], max_tokens=48):
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                   if c.choices)


@pytest.fixture(scope="module")
def decoder():
    return Decoder.from_pretrained(TARGET, DRAFTER, dtype="float32")


def _direct(dec, spec, prompt=PROMPTS[0], max_tokens=48):
    """What the Python API decodes for the same pair (greedy, the same grammar)."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
    return dec.generate([prompt], sp, use_tqdm=False)[0].text


WAYS = [  # (request fields, the same grammar as params, check of the text)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
    ({"structured_outputs": {"regex": REGEX}}, StructuredOutputsParams(regex=REGEX),
     lambda t: re.fullmatch(REGEX, t) is not None),
    ({"guided_choice": CHOICES}, StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA),
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("way", range(len(WAYS)))
def test_every_way_of_asking_parses_and_equals_the_python_api(decoder, client, way, stream):
    extra, spec, ok = WAYS[way]
    text = _complete(client, stream, extra)
    assert ok(text), text
    assert text == _direct(decoder, spec)


def test_chat_with_response_format_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,field", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_grammars_are_refused_by_name(server, client, extra, field):
    served = server.state.engine.num_rounds
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, False, extra)
    assert e.value.body["param"] == field, e.value.body
    assert server.state.engine.num_rounds == served  # refused before any work


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_cut_by_max_tokens_says_so(client, stream):
    """A schema that needs more tokens than max_tokens allows ends with "length" and
    grammar_complete false; one that finishes says true."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], temperature=0, extra_body={"guided_json": SCHEMA})
    if stream:
        last = [c for c in client.completions.create(stream=True, max_tokens=3, **kw) if c.choices][-1]
        choice = last.choices[0]
    else:
        choice = client.completions.create(max_tokens=3, **kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.model_extra["grammar_complete"] is False
    whole = client.completions.create(max_tokens=48, **kw).choices[0]
    assert whole.finish_reason == "stop" and whole.model_extra["grammar_complete"] is True


def test_grammars_compile_off_the_engine_thread(server, client, monkeypatch):
    """A grammar the engine has not seen is compiled before its request reaches the engine
    thread, so other requests' rounds never wait for a large schema."""
    from dspark_rt.structured.grammar import GrammarBook
    compiled_on, real = [], GrammarBook.compile

    def spy(book, spec):
        if spec.key() not in book.cache:
            compiled_on.append(threading.current_thread().name)
        return real(book, spec)

    monkeypatch.setattr(GrammarBook, "compile", spy)
    fresh = {"type": "object", "properties": {"unseen_field": {"type": "boolean"}},
             "required": ["unseen_field"], "additionalProperties": False}
    text = _complete(client, False, {"guided_json": fresh})
    assert isinstance(json.loads(text)["unseen_field"], bool)
    assert compiled_on and "dspark-rt-engine" not in compiled_on, compiled_on
