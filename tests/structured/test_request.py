"""Every way a request body asks for structured output, read into StructuredOutputsParams, and
the errors that name the field."""
import pytest

from dspark_rt.structured import StructuredOutputsParams as S
from dspark_rt.structured.request import FieldError, from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body,want", [
    ({}, None), ({"response_format": {"type": "text"}}, None), ({"guided_json": None}, None),
    ({"response_format": {"type": "json_object"}}, S(json={"type": "object"})),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}}, S(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, S(regex="[a-z]+")),
    ({"structured_outputs": {"json_object": True}}, S(json={"type": "object"})),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, S(json=SCHEMA)),
    ({"guided_regex": "a|b"}, S(regex="a|b")), ({"guided_choice": ["x", "y"]}, S(choice=["x", "y"])),
    ({"guided_grammar": 'root ::= "a"'}, S(grammar='root ::= "a"'))])
def test_each_way_of_asking(body, want):
    got = from_request(body)
    assert (got is None and want is None) or got.key() == want.key()


@pytest.mark.parametrize("body,field,why", [
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "Unsupported type"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not served"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "parenthesis"),
    ({"guided_regex": "(a"}, "guided_regex", "parenthesis"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "not defined"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not served"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "besides")])
def test_errors_name_the_field(body, field, why):
    with pytest.raises(FieldError, match=why) as e:
        from_request(body)
    assert e.value.field == field and str(e.value).startswith(field)
