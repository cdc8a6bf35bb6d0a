"""Constrained decoding (issue #28, `exod.runner.grammar`): a random-weight model writes JSON that validates by
construction, whatever the schema of the supported subset, several requests in one batch each held to its
own; and through the API, in every dialect, with the clients that rely on it.

The property test runs the runner's batch in this process on the tiny model (its weights are random: nothing
but the constraint makes its output valid). Schemas are drawn by a Hypothesis strategy over the subset
llguidance supports, bounded so that a valid document is finite, and checked satisfiable with
hypothesis-jsonschema before the model is asked.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import anthropic
import attrs
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from daemon_harness import ready_daemon, runner_pids
from exod.host.models import resolve_model
from exod.host.tiny_model import make_tiny_model
from exod.runner import protocol as p
from exod.runner.tool_prompt import call_head

MODEL = "exod/tiny-qwen2"


# -- the property: valid by construction ------------------------------------------------------------------

_names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
_leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 10**6),
    ),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-50, 50)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.text("xyz", max_size=3), min_size=1, max_size=3, unique=True)),
    st.builds(lambda x: {"const": x}, st.integers(0, 9)),
    st.just({"type": "string", "pattern": "^[a-c]{1,3}$"}),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
                "additionalProperties": False,
            },
            st.sets(st.sampled_from(sorted(props))),
        )
    )


_schemas = st.recursive(
    _leaves,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mlx_lm.utils import load

    hf = tmp_path_factory.mktemp("hf")
    make_tiny_model(MODEL, hf_home=hf)
    return load(str(resolve_model(MODEL, hf_home=hf, offline=True)))


class _Alone:
    """One rank: the lockstep agrees with itself."""

    single = True

    def agree(self, values: list[int]) -> list[list[int]]:
        return [values]


def generate(
    tiny: Any, grammars: list[dict[str, Any]], seed: int = 0, *, prompt: str = "answer", batch: Any = None
) -> dict[str, tuple[str, Any]]:
    """Each constraint's request decoded in one batch: request id → (text, the Done or RequestError)."""
    from exod.runner.batch import Batch, BatchLimits, prompt_tokens

    model, tokenizer = tiny
    sent: list[tuple[type, dict[str, Any]]] = []
    send = lambda cls, **f: sent.append((cls, f))  # noqa: E731
    if batch is None:
        batch = Batch(model, tokenizer, limits=BatchLimits(), send=send, rank=0, lockstep=_Alone())
    batch.send = send
    for i, grammar in enumerate(grammars):
        request = p.Generate(
            f"r{i}",
            prompt_messages=[{"role": "user", "content": f"{prompt} {i}"}],
            max_tokens=400,
            temperature=1.0,
            seed=seed + i,
            grammar=grammar,
        )
        batch.join(request, prompt_tokens(tokenizer, request))
    while not batch.idle:
        batch.step()
    out: dict[str, tuple[str, Any]] = {f"r{i}": ("", None) for i in range(len(grammars))}
    for cls, fields in sent:
        text, end = out[fields["request_id"]]
        out[fields["request_id"]] = (text + fields["text"], end) if cls is p.Token else (text, (cls, fields))
    return out


def satisfiable(schema: dict[str, Any]) -> bool:
    """Whether some document validates (hypothesis-jsonschema's canonical form says so, or finds none)."""
    from hypothesis_jsonschema._canonicalise import FALSEY, canonicalish

    return canonicalish(schema) != FALSEY


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(_schemas.filter(satisfiable), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_a_random_weight_model_writes_valid_json_for_any_schema_several_in_one_batch(tiny, schemas, seed):
    for (text, end), schema in zip(
        generate(tiny, [{"json_schema": s} for s in schemas], seed).values(), schemas, strict=True
    ):
        cls, fields = end
        assert cls is p.Done and fields["finish_reason"] is p.FinishReason.STOP, (schema, text, fields)
        jsonschema.validate(json.loads(text), schema)


def test_a_pattern_and_a_grammar_hold_too_beside_a_free_request(tiny):
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    out = generate(tiny, [{"regex": "[a-c]{3}-[0-9]{2}"}, None, {"lark": lark}])
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", out["r0"][0])
    assert out["r1"][1][0] is p.Done  # the free one beside them: random text, its own way
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", out["r2"][0]), out["r2"][0]


def test_a_prompt_prefilled_in_chunks_or_read_from_the_prompt_cache_leaves_the_constraint_whole(tiny):
    """The matcher sees the prompt once, however it is prefilled: chunk by chunk, or most of it from the cache
    of an earlier turn (it then starts from the first sampled token, as always)."""
    from exod.runner.batch import Batch, BatchLimits

    model, tokenizer = tiny
    chunked = Batch(
        model, tokenizer, limits=BatchLimits(prefill_step=4), send=lambda *_, **__: None, rank=0, lockstep=_Alone()
    )
    small = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}
    for turn in range(2):  # the same prompt again: the second reads all but its last token from the cache
        ((text, (cls, fields)),) = generate(
            tiny, [{"json_schema": small}], turn, prompt="a long prompt " * 10, batch=chunked
        ).values()
        assert cls is p.Done and fields["finish_reason"] is p.FinishReason.STOP
        assert 0 <= json.loads(text)["a"] <= 99
    assert fields["cached_tokens"] > 0


# -- a forced tool call: compact, so it ends well within max_tokens ---------------------------------------

FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "boolean"},
    },
    "required": ["unit", "days", "alerts"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
# the longest compact call of each tool: with one token of at least a byte each, and the end of sequence,
# no forced call without free whitespace takes more tokens than the longest of them has bytes, plus one
LONGEST = [
    call_head("get_forecast") + '{"unit":"C","days":14,"alerts":false}}\n</tool_call>',
    call_head("get_time") + '{"zone":"UTC"}}\n</tool_call>',
]
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


@pytest.mark.parametrize("choice", [p.REQUIRED, "get_forecast"])
def test_a_forced_call_has_no_free_whitespace_and_ends_well_within_max_tokens(tiny, choice):
    """#48: a model that favours whitespace (here a logit bias on every whitespace token) still writes a
    forced call as compact JSON: no whitespace between its tokens but the envelope's fixed spaces, so each of
    18 seeds, decoded together, ends with a call that validates, within the tokens its longest form needs."""
    from exod.runner.batch import Batch, BatchLimits, prompt_tokens
    from exod.runner.output import forced_call

    model, tokenizer = tiny
    spaces = [i for i in range(len(tokenizer._tokenizer)) if (t := tokenizer.decode([i])) and t.isspace()]
    assert spaces, "the tiny vocabulary has whitespace tokens to favour"
    sent: list[tuple[type, dict[str, Any]]] = []
    send = lambda cls, **f: sent.append((cls, f))  # noqa: E731
    batch = Batch(model, tokenizer, limits=BatchLimits(), send=send, rank=0, lockstep=_Alone())
    most = max(len(text.encode()) for text in LONGEST) + 1
    requests = [
        p.Generate(
            f"s{seed}",
            prompt_messages=ASK,
            max_tokens=most,
            temperature=1.0,
            seed=seed,
            tools=FORCED_TOOLS,
            tool_choice=choice,
            logit_bias={str(i): 8.0 for i in spaces},
        )
        for seed in range(18)
    ]
    for request in requests:
        batch.join(request, prompt_tokens(tokenizer, request))
    while not batch.idle:
        batch.step()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for request in requests:
        said = [f for cls, f in sent if f["request_id"] == request.request_id]
        ids = [f["token_id"] for f in said if "token_id" in f and f["token_id"] is not None]
        (done,) = [f for f in said if "finish_reason" in f]
        assert done["finish_reason"] is p.FinishReason.TOOL_CALLS, (request.seed, tokenizer.decode(ids), done)
        (call,) = [f for f in said if "arguments" in f]
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        assert choice in (p.REQUIRED, call["name"])
        written = forced_call(tokenizer, request).removeprefix("<tool_call>\n") + tokenizer.decode(ids)
        head = call_head(call["name"])
        assert written.startswith(head) and written.endswith("}\n</tool_call>"), written
        assert not re.search(r"\s", STRINGS.sub("", written[len(head) : -len("}\n</tool_call>")])), written


@pytest.mark.parametrize(
    ("grammar", "named"),
    [
        ({"json_schema": {"type": "strnig"}}, "strnig"),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json_schema": {"$ref": "#/$defs/missing"}}, "missing"),
        ({"regex": "[a-"}, "regex"),
        ({"lark": "start: undefined_rule"}, "undefined_rule"),
    ],
)
def test_a_constraint_that_cannot_be_compiled_is_refused_naming_the_part(tiny, grammar, named):
    ((text, (cls, fields)),) = generate(tiny, [grammar]).values()
    assert text == "" and cls is p.RequestError and fields["invalid"] and fields["grammar"]
    assert named in fields["message"]


# -- through the API, as clients use it -------------------------------------------------------------------

CONFIG = f"""
[daemon]
port = 0
offline = true

[[place]]
model = "{MODEL}"
ranks = 2
"""
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather?"}]


class Person(BaseModel):  # what `.parse()` users write: bounded, so a random model's answer is finite
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=150)
    kind: Literal["cat", "dog"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ready_daemon(tmp_path_factory.mktemp("structured"), CONFIG, {MODEL: 0}) as (url, _):
        yield url
    assert runner_pids() == []


@pytest.fixture
def client(daemon):
    return openai.OpenAI(base_url=f"{daemon}/v1", api_key="unused", max_retries=0, timeout=60)


def test_parse_gets_an_instance_of_its_model_from_two_ranks(client):
    """The OpenAI SDK's `.parse()` (instructor, pydantic-ai and agents' output_type ask the same): strict
    json_schema, decoded on a 2-rank instance whose ranks mask alike."""
    done = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=200, seed=3)
    assert isinstance(done.choices[0].message.parsed, Person) and done.choices[0].finish_reason == "stop"


def test_json_mode_and_vllms_guided_extensions(client, daemon):
    free = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=600, seed=1
    )
    if free.choices[0].finish_reason == "stop":  # an object of any size: valid whenever it ended on its own
        assert isinstance(json.loads(free.choices[0].message.content), dict)
    else:
        assert free.choices[0].message.content.startswith("{")
    regex = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=50, extra_body={"guided_regex": "(yes|no), [0-9]{2}"}
    )
    assert re.fullmatch("(yes|no), [0-9]{2}", regex.choices[0].message.content)
    text = client.completions.create(model=MODEL, prompt="x", max_tokens=60, extra_body={"guided_json": WEATHER})
    jsonschema.validate(json.loads(text.choices[0].text), WEATHER)
    both = httpx.post(
        f"{daemon}/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "guided_regex": "a", "guided_json": {"type": "object"}},
    )
    assert both.status_code == 400 and "one constraint at a time" in both.json()["error"]["message"]


def test_a_schema_that_cannot_be_compiled_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad)
    assert refused.value.body["param"] == "response_format" and "strnig" in refused.value.body["message"]
    done = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)  # the runner serves on
    assert done.choices[0].finish_reason == "length"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_always_parses_and_its_arguments_fit_the_schema(client, choice):
    done = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=5
    )
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_forced_call_cut_short_ends_with_length_never_a_silent_stop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=3)
    assert done.choices[0].finish_reason == "length" and not done.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_call_cut_short_is_max_tokens_in_anthropics_messages_never_end_turn(daemon, choice):
    """#28: the call begun for the model and cut by ``max_tokens``: Anthropic's clients see "max_tokens" (raise
    the limit and retry), never "end_turn" with a call's beginning passed off as the answer; streamed alike."""
    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0)
    asked = {"model": MODEL, "max_tokens": 3, "messages": ASK, "tool_choice": choice}
    asked["tools"] = [{"name": "get_weather", "input_schema": WEATHER}]
    done = claude.messages.create(**asked)
    assert done.stop_reason == "max_tokens" and done.usage.output_tokens == 3
    assert [b.type for b in done.content if b.type == "tool_use"] == []
    with claude.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and not [b for b in final.content if b.type == "tool_use"]


def test_a_forced_call_cut_short_leaves_a_response_incomplete(client):
    """#28: the same in the Responses API: ``incomplete``, for ``max_output_tokens``, with no function call;
    the stream's last event says so too."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    asked = {"model": MODEL, "input": "Weather?", "tools": tools, "max_output_tokens": 3}
    asked["tool_choice"] = {"type": "function", "name": "get_weather"}
    done = client.responses.create(**asked)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in done.output if item.type == "function_call"] == []
    events = list(client.responses.create(**asked, stream=True))
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == last.usage.output_tokens == 3


def test_the_other_dialects_constrain_alike(client, daemon):
    import ollama

    answered = client.responses.create(
        model=MODEL,
        input="Weather?",
        max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}},
    )
    jsonschema.validate(json.loads(answered.output_text), WEATHER)
    assert answered.text.format.type == "json_schema"
    claude = anthropic.Anthropic(base_url=daemon, api_key="unused", max_retries=0)
    used = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=ASK,
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (block,) = [b for b in used.content if b.type == "tool_use"]
    jsonschema.validate(block.input, WEATHER)
    llama = ollama.Client(host=daemon, timeout=60)
    formatted = llama.chat(model=MODEL, messages=ASK, format=WEATHER, stream=False, options={"num_predict": 200})
    jsonschema.validate(json.loads(formatted.message.content), WEATHER)


def test_a_tokenizer_the_engine_cannot_read_refuses_the_request_and_the_batch_goes_on(tiny):
    """A model whose tokenizer llguidance cannot take (a slow, pure-Python one, say) refuses constrained
    requests with a 400, not a runner failure."""
    from exod.runner.batch import Batch, BatchLimits

    model, tokenizer = tiny
    batch = Batch(model, tokenizer, limits=BatchLimits(), send=lambda *_, **__: None, rank=0, lockstep=_Alone())
    batch.grammars = attrs.evolve(
        batch.grammars, tokenizer=type("Slow", (), {"_tokenizer": object(), "eos_token_id": 0})()
    )
    out = generate(tiny, [{"regex": "a+"}, None], batch=batch)
    cls, fields = out["r0"][1]
    assert cls is p.RequestError and fields["grammar"] and "cannot be constrained" in fields["message"]
    assert out["r1"][1][0] is p.Done
