"""Structured outputs as a user checks them (issue 13's acceptance): the real `openai` client
against `treadle serve` on the default model, 20 JSON schemas sampled at temperature 0.7 with 5
seeds each, every output validated by `jsonschema`; `json_object`, `choice` and `regex` too."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from serve_helpers import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
SEEDS = range(5)

_name = {"type": "string", "minLength": 1, "maxLength": 24}
_int = {"type": "integer", "minimum": 0, "maximum": 1000}
_color = {"enum": ["red", "green", "blue"]}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a person.", _obj({"name": _name, "age": _int})),
    "city": ("Describe a city.", _obj({"city": _name, "country": _name, "population": _int})),
    "boolean": ("Is the sky blue?", _obj({"answer": {"type": "boolean"}})),
    "enum": ("Pick a color.", _obj({"color": _color})),
    "enum_ints": ("Pick a size.", _obj({"size": {"enum": [1, 2, 3]}})),
    "array_of_strings": (
        "List some fruits.",
        _obj({"fruits": {"type": "array", "items": _name, "minItems": 1, "maxItems": 4}}),
    ),
    "array_of_ints": (
        "Give some numbers.",
        _obj({"numbers": {"type": "array", "items": _int, "minItems": 2, "maxItems": 5}}),
    ),
    "nested": (
        "Describe a book.",
        _obj({"title": _name, "author": _obj({"name": _name, "born": _int})}),
    ),
    "deeply_nested": (
        "Describe a company.",
        _obj({"company": _obj({"ceo": _obj({"name": _name}), "founded": _int})}),
    ),
    "array_of_objects": (
        "List two pets.",
        _obj(
            {
                "pets": {
                    "type": "array",
                    "items": _obj({"name": _name, "legs": {"type": "integer", "maximum": 8}}),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    "optional_field": (
        "Describe a car.",
        _obj({"make": _name, "year": _int, "color": _color}, required=["make"]),
    ),
    "number": ("Give a temperature.", _obj({"celsius": {"type": "number"}})),
    "bounded_int": (
        "Rate a movie.",
        _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}}),
    ),
    "string_pattern": (
        "Give a date.",
        _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    ),
    "const": ("Say the status.", _obj({"status": {"const": "ok"}, "code": _int})),
    "any_of": (
        "Give an id.",
        _obj({"id": {"anyOf": [_int, {"type": "string", "maxLength": 12}]}}),
    ),
    "nullable": (
        "Give a nickname.",
        _obj({"nickname": {"type": ["string", "null"], "maxLength": 16}}),
    ),
    "top_level_array": (
        "List three colors.",
        {"type": "array", "items": _color, "minItems": 3, "maxItems": 3},
    ),
    "many_fields": (
        "Describe a laptop.",
        _obj(
            {
                "brand": _name,
                "ram_gb": _int,
                "ssd": {"type": "boolean"},
                "color": _color,
                "ports": {"type": "array", "items": _name, "maxItems": 3},
            }
        ),
    ),
    "enum_array_nested": (
        "Plan a week.",
        _obj(
            {
                "days": {
                    "type": "array",
                    "items": _obj(
                        {"day": {"enum": ["mon", "tue", "wed"]}, "busy": {"type": "boolean"}}
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    srv = RemoteServer(["--max-model-len", "1024"], tmp_path_factory.mktemp("structured"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, prompt: str, seed: int, **fields: Any) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=160,
        temperature=0.7,
        seed=seed,
        **fields,
    )
    choice = out.choices[0]
    return choice.message.content or "", choice.finish_reason


def test_twenty_json_schemas_five_seeds_each_validate(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) == 20
    jobs = [(name, seed) for name in SCHEMAS for seed in SEEDS]

    def run(job: tuple[str, int]) -> tuple[str, int, str, str]:
        name, seed = job
        prompt, schema = SCHEMAS[name]
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        }
        text, finish = _chat(client, prompt + " Answer in JSON.", seed, response_format=fmt)
        return name, seed, text, finish

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    texts = set()
    for name, seed, text, finish in results:
        assert finish == "stop", (name, seed, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name][1])
        texts.add(text)
    assert len(texts) > 40  # sampled, not one greedy answer per schema


def test_json_object_choice_and_regex(client: openai.OpenAI) -> None:
    for seed in SEEDS:
        text, finish = _chat(
            client,
            'Reply with a JSON object with the keys "name" and "age" of a dog.',
            seed,
            response_format={"type": "json_object"},
        )
        assert finish == "stop" and isinstance(json.loads(text), dict), text
        choice = {"structured_outputs": {"choice": ["cat", "dog", "bird"]}}
        text, _ = _chat(client, "Name a pet.", seed, extra_body=choice)
        assert text in ("cat", "dog", "bird")
        regex = {"structured_outputs": {"regex": "[A-Z][a-z]{2,8} [0-9]{1,3}"}}
        text, _ = _chat(client, "Give a name and an age.", seed, extra_body=regex)
        assert re.fullmatch("[A-Z][a-z]{2,8} [0-9]{1,3}", text), text


ARITHMETIC_GBNF = """
root ::= expr
expr ::= term (op term){0,2}
term ::= num | "(" num op num ")"
op   ::= " + " | " - " | " * "
num  ::= [1-9] [0-9]?
"""
ARITHMETIC = re.compile(r"(?:[1-9][0-9]?|\([1-9][0-9]? [-+*] [1-9][0-9]?\))")


def test_a_gbnf_grammar_constrains_sampled_outputs(client: openai.OpenAI) -> None:
    """llama.cpp's GBNF, as its own `grammar` field and as `structured_outputs.grammar`: 20
    seeds at temperature 0.8 all parse (issue 26 item 4)."""
    term = ARITHMETIC.pattern
    whole = re.compile(rf"{term}(?: [-+*] {term}){{0,2}}")
    texts = set()
    for seed in range(20):
        where = {"grammar": ARITHMETIC_GBNF} if seed % 2 else None
        body = where or {"structured_outputs": {"grammar": ARITHMETIC_GBNF}}
        out = client.completions.create(
            model=MODEL,
            prompt="Write an arithmetic expression:",
            max_tokens=40,
            temperature=0.8,
            seed=seed,
            extra_body=body,
        )
        text = out.choices[0].text
        assert out.choices[0].finish_reason == "stop", (seed, text)
        assert whole.fullmatch(text), (seed, text)
        texts.add(text)
    assert len(texts) > 5  # sampled


def test_a_bad_gbnf_grammar_is_a_400_naming_the_line(client: openai.OpenAI) -> None:
    bad = 'root ::= expr\nexpr ::= [0-9]+\nbroken ::= "x" @@ "y"\n'
    for body in ({"grammar": bad}, {"structured_outputs": {"grammar": bad}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
        assert "at line 3" in str(e.value), e.value
    both = {"grammar": bad, "structured_outputs": {"regex": "a"}}
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=both)
