"""Structured output offline on the demo model: every JSON schema of a 32-schema suite, regexes,
choices and EBNF grammars produce matching outputs; free requests are untouched beside
constrained ones; bad constraints are refused before the engine sees them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from schemas import SCHEMAS  # noqa: E402  (tests/structured_output/schemas.py)

from octavo import SamplingParams
from octavo.structured_output import StructuredOutputsParams

PROMPTS = ["def main():", "import os\n", "# the settings\nconfig = ", "class Point:"]


def constrained(constraint: dict, max_tokens: int = 96, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint, **extra
    )


def test_every_schema_of_the_suite_gives_valid_json(demo_llm):
    params = [constrained({"json": schema}) for schema in SCHEMAS]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    outputs = demo_llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
        assert "\n" not in text  # compact: no free whitespace for the model to loop on


def test_sampled_outputs_validate_too(demo_llm):
    schema = SCHEMAS[16]  # nested object with a bounded array of strings
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs={"json": schema})
        for i in range(8)
    ]
    for output in demo_llm.generate(["def f():"] * 8, params, use_tqdm=False):
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.parametrize(
    "constraint, pattern",
    [
        ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, r"[0-9]{3}-[a-z]{2,4}"),
        ({"regex": r"(yes|no), because [a-z ]{1,20}\."}, r"(yes|no), because [a-z ]{1,20}\."),
        ({"choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ({"choice": ['say "hi"', "a\\b"]}, r'say "hi"|a\\b'),
        (
            {"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'},
            r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)",
        ),
    ],
    ids=["regex", "regex-words", "choice", "choice-escapes", "ebnf"],
)
def test_regex_choice_grammar_and_json_object_outputs_match(demo_llm, constraint, pattern):
    outputs = demo_llm.generate(
        PROMPTS, [constrained(constraint, 48) for _ in PROMPTS], use_tqdm=False
    )
    for output in outputs:
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"


def test_json_object_outputs_are_objects(demo_llm):
    """Any object: the demo model may nest keys until max_tokens (nothing bounds it), but what
    it finishes parses as an object, and what it cuts short is the start of one."""
    params = constrained({"json_object": True})
    outputs = demo_llm.generate(PROMPTS, [params] * len(PROMPTS), use_tqdm=False)
    finished = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all(o.outputs[0].text.startswith("{") for o in outputs)


def test_a_free_request_is_untouched_beside_constrained_ones(demo_llm):
    free = SamplingParams(temperature=0.0, max_tokens=32)
    alone = demo_llm.generate(PROMPTS, [free] * len(PROMPTS), use_tqdm=False)
    mixed_params = [free if i % 2 == 0 else constrained({"json": SCHEMAS[i]}) for i in range(8)]
    mixed = demo_llm.generate(PROMPTS * 2, mixed_params, use_tqdm=False)
    for i in range(0, 8, 2):
        assert mixed[i].outputs[0].token_ids == alone[i % 4].outputs[0].token_ids


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"type": "nonsense"}}, "structured_outputs.json cannot be compiled"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"regex": "([a-z"}, "structured_outputs.regex cannot be compiled"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar cannot be compiled"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "structured_outputs.choice must hold strings"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({}, "exactly one of"),
    ],
)
def test_a_bad_constraint_is_refused_before_the_engine(demo_llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        demo_llm.generate(["x"], constrained(constraint), use_tqdm=False)
    assert not demo_llm.engine.has_unfinished_requests()


def test_params_are_keyed_by_their_constraint():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "string"}}, "type": "object"}')
    assert a.key() == b.key() and a.kind == "json"
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_keeps_constrained_outputs_exact(demo_llm, method):
    """Drafts are masked at every position they are verified at and given back after, so a
    constrained greedy request gets the same tokens with speculation as without."""
    from octavo import LLM

    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    else:
        spec["model"] = str(demo_llm.engine.args.model)
    llm = LLM(str(demo_llm.engine.args.model), kv_cache_memory="64MiB", speculative_config=spec)
    schemas = SCHEMAS[::3]
    params = [constrained({"json": schema}) for schema in schemas]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    expected = demo_llm.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for schema, e, g in zip(schemas, expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        jsonschema.validate(json.loads(g.outputs[0].text), schema)
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_bounded_strings_never_admit_control_characters(demo_llm):
    """xgrammar's own grammar for minLength/maxLength strings admits raw control characters;
    octavo's keeps them to what JSON allows unescaped."""
    import torch

    backend = demo_llm.engine.grammar_backend()
    decoded = backend.tokenizer_info.decoded_vocab
    control = [i for i, b in enumerate(decoded) if len(b) == 1 and b[0] < 0x20]
    assert control  # the demo tokenizer has byte tokens for them
    for schema in ({"type": "string", "maxLength": 8}, {"type": "string", "minLength": 2}):
        matcher = backend.matcher(StructuredOutputsParams(json=schema))
        assert matcher.accept_string('"')
        bitmask = backend.allocate_bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = ((bitmask[0].unsqueeze(-1) >> torch.arange(32)) & 1).reshape(-1).bool()
        assert not allowed[control].any()
        assert allowed[[i for i, b in enumerate(decoded) if b == b"a"]].all()


def test_the_engine_config_decides_whitespace_unless_the_request_does(demo_llm):
    import torch

    from octavo import LLM
    from octavo.config import EngineArgs
    from octavo.errors import ConfigError

    def newline_allowed(backend, params) -> bool:
        matcher = backend.matcher(params)
        assert matcher.accept_string("{")
        bitmask = backend.allocate_bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = ((bitmask[0].unsqueeze(-1) >> torch.arange(32)) & 1).reshape(-1).bool()
        newline = [i for i, b in enumerate(backend.tokenizer_info.decoded_vocab) if b == b"\n"]
        return bool(allowed[newline].all())

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compact = demo_llm.engine.grammar_backend()
    loose_llm = LLM(
        str(demo_llm.engine.args.model),
        kv_cache_memory="16MiB",
        structured_outputs_config={"disable_any_whitespace": False},
    )
    loose = loose_llm.engine.grammar_backend()
    assert not newline_allowed(compact, StructuredOutputsParams(json=schema))
    assert newline_allowed(loose, StructuredOutputsParams(json=schema))
    assert newline_allowed(compact, StructuredOutputsParams(json=schema, any_whitespace=True))
    assert not newline_allowed(loose, StructuredOutputsParams(json=schema, any_whitespace=False))
    for bad, field in (({"backend": "outlines"}, "backend"), ({"whitespace": 1}, "whitespace")):
        with pytest.raises(ConfigError, match=f"structured_outputs_config.{field}"):
            EngineArgs(structured_outputs_config=bad)


def test_a_structural_tag_holds_its_sequence(demo_llm):
    """xgrammar's structural-tag format: a fixed opening, a JSON value of a schema, a closing."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "<answer>"},
                {
                    "type": "json_schema",
                    "json_schema": {**schema, "required": ["n"]},
                    "max_whitespace_cnt": 1,  # the tag's own whitespace rule
                },
                {"type": "const_string", "value": "</answer>"},
            ],
        },
    }
    params = constrained({"structural_tag": tag}, 48)
    for output in demo_llm.generate(PROMPTS, [params] * len(PROMPTS), use_tqdm=False):
        match = re.fullmatch(r"<answer>(.*)</answer>", output.outputs[0].text, re.S)
        assert match, output.outputs[0].text
        jsonschema.validate(json.loads(match.group(1)), {**schema, "required": ["n"]})
