"""No request can take the server down: property-based fuzzing of the generation routes over
real HTTP.

Bodies are drawn from the request schemas the server publishes in /openapi.json, then mutated:
wrong types, edge numbers, odd and huge strings, huge arrays, deep nesting, broken JSON, bodies
that are not objects and other content types. Whatever arrives, the answer is a 200 (a stream
that ends with ``data: [DONE]``) or an OpenAI error body with status 400, 404 or 503
``queue_full``; a 400 about one bad field names it in ``param``; the engine never dies, and it is
idle with every KV block free afterwards. A request that kills the engine fails its test, and
the next request gets a fresh server, so each failure is the request's own.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Iterator, Optional

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from server_constants import MODEL_NAME

from octavo.entrypoints.openai.chat_protocol import ChatCompletionRequest
from octavo.entrypoints.openai.protocol import CompletionRequest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ROUTES = (COMPLETIONS, CHAT)
REQUEST_MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}
HTTP_TIMEOUT_S = 120  # only so a hung request fails instead of hanging the run

# The smallest valid body of each route; mutations change one field of it.
BASE_BODIES = {
    COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
# Generated bodies always set their route's length field; SMALL_WORK bounds it, and n, anywhere.
LENGTH_FIELDS = {COMPLETIONS: "max_tokens", CHAT: "max_completion_tokens"}
SMALL_WORK = {
    "max_tokens": st.integers(1, 4),
    "max_completion_tokens": st.integers(1, 4),
    "n": st.integers(1, 3),
}

ANY_STATUS = frozenset({200, 400, 404, 503})
NAN, INF = float("nan"), float("inf")
# Drawn now and then for an integer or number field, where its bounds allow them.
EDGE_INTEGERS = (
    0,
    1,
    -1,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**53,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    2**64,
    10**30,
)
EDGE_FLOATS = (0.0, -0.0, 5e-324, 1e-300, 0.5, 1e308, -1e308, 1.7976931348623157e308)
EDGE_NUMBERS = (
    0,
    -1,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    1e308,
    -1e308,
    1e-300,
    NAN,
    INF,
    -INF,
)
# Values that killed the engine (issue 14): each must be a 400 naming its field.
KNOWN_KILLERS = (
    ("top_k", 2**31),
    ("top_k", 2**63),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("seed", 10**30),
)
JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
WORDS = ("user", "assistant", "system", "developer", "text", "hi", MODEL_NAME)
ODD_TEXT = (
    "\u0000",
    "😀👩‍👩‍👧🏳️‍🌈",
    "\u202eRTL override\u202c",
    "שלום עולם",
    "مرحبا",
    "e\u0301\u0301\u0301",
    "\ufeff",
    "\uffff",
    "\U0010ffff",
    "a\r\nb\tc",
    "</s><s>",
    "{{ bos_token }}{% raw %}",
)
# Raw bytes inside a JSON string: escaped lone surrogates, a pair, and invalid UTF-8.
ODD_STRING_BYTES = (b"\\ud800", b"\\udfff", b"\\ud83d\\ude00", b"\xed\xa0\x80", b"\xff", b"\xc3")
PLACEHOLDER = "\u2063placeholder\u2063"
CONTENT_TYPES = (
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/octet-stream",
    "application/xml",
)
# Malformed JSON, and JSON parsers disagree on (a BOM, duplicate keys, huge numbers).
BROKEN_JSON = (
    b"",
    b" ",
    b"{",
    b"}",
    b"{'prompt': 'hi'}",
    b'{"prompt": "hi",}',
    b'{"prompt": "hi"} x',
    b'{"prompt": "hi" // c\n}',
    b'\xef\xbb\xbf{"prompt": "hi"}',
    b'{"prompt": "hi", "prompt": 5}',
    b'{"prompt": "hi", "max_tokens": 01}',
    b'{"prompt": "hi", "max_tokens": +1}',
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    b"prompt=hi&max_tokens=2",
    b"\x00",
)
DEPTHS = (64, 201, 1000, 100_000)
MAX_OPTIONAL_FIELDS = 4

# Reproducible runs; no explain phase, as each rerun of a killing example restarts a server.
FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example],
)


# --- JSON schema -> hypothesis strategies ------------------------------------------------------

Schema = dict[str, Any]


class SchemaStrategies:
    """Strategies for values valid under the JSON schema constructs pydantic emits: $ref,
    anyOf/oneOf/allOf, const, enum, objects, arrays, strings and bounded numbers."""

    def __init__(self, components: dict[str, Any]) -> None:
        self.components = components
        self._by_ref: dict[str, SearchStrategy] = {}

    def resolve(self, schema: Schema) -> dict[str, Any]:
        """``schema``, or the component its ``$ref`` names."""
        ref = schema.get("$ref")
        return schema if ref is None else self.components[ref.rsplit("/", 1)[1]]

    def json_types(self, schema: Schema) -> frozenset[str]:
        """The JSON types ``schema`` accepts (an integer is a number)."""
        schema = self.resolve(schema)
        options = schema.get("anyOf", schema.get("oneOf", schema.get("allOf")))
        if options is not None:
            types = frozenset().union(*(self.json_types(option) for option in options))
        elif "const" in schema or "enum" in schema:
            values = schema.get("enum", [schema.get("const")])
            types = frozenset(json_type(value) for value in values)
        elif "type" in schema:
            kinds = schema["type"]
            types = frozenset([kinds] if isinstance(kinds, str) else kinds)
        else:
            types = JSON_TYPES
        return types | {"integer"} if "number" in types else types

    def values(self, schema: Schema) -> SearchStrategy:
        """Values valid under ``schema``."""
        ref = schema.get("$ref")
        if ref is not None:
            if ref not in self._by_ref:
                self._by_ref[ref] = st.deferred(lambda: self.values(self.resolve(schema)))
            return self._by_ref[ref]
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.values(option) for option in schema[key]])
        if len(schema.get("allOf", ())) == 1:
            return self.values(schema["allOf"][0])
        kinds = schema.get("type")
        if kinds is None:
            return ANY_JSON
        if isinstance(kinds, list):
            return st.one_of([self.values({**schema, "type": kind}) for kind in kinds])
        return getattr(self, f"_{kinds}")(schema)

    @staticmethod
    def _null(_: dict[str, Any]) -> SearchStrategy:
        return st.none()

    @staticmethod
    def _boolean(_: dict[str, Any]) -> SearchStrategy:
        return st.booleans()

    @staticmethod
    def _integer(schema: Schema, limit: Optional[int] = None) -> SearchStrategy:
        low, high = integer_bounds(schema)
        if limit is not None:
            low = -limit if low is None else max(low, -limit)
            high = limit if high is None else min(high, limit)
        edges = [
            edge
            for edge in (low, high, *EDGE_INTEGERS)
            if edge is not None and (low is None or edge >= low) and (high is None or edge <= high)
        ]
        return with_edges(st.integers(low, high), edges)

    def _number(self, schema: Schema) -> SearchStrategy:
        floats = st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum")),
            schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
        floats = with_edges(floats, [edge for edge in EDGE_FLOATS if within_bounds(edge, schema)])
        low, high = integer_bounds(schema)
        if low is not None and high is not None and low > high:
            return floats
        # JSON integers are numbers too; past 2**53 they stop being exact floats.
        return floats | self._integer(schema, limit=2**53)

    @staticmethod
    def _string(schema: Schema) -> SearchStrategy:
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        low, high = schema.get("minLength", 0), schema.get("maxLength", math.inf)
        text = st.text(min_size=low, max_size=max(low, min(high, 24)))
        return with_edges(text, [word for word in WORDS if low <= len(word) <= high])

    def _array(self, schema: Schema) -> SearchStrategy:
        low = schema.get("minItems", 0)
        high = max(low, min(schema.get("maxItems", 3), 3))
        return st.lists(self.values(schema.get("items", {})), min_size=low, max_size=high)

    def _object(self, schema: Schema) -> SearchStrategy:
        properties = schema.get("properties", {})
        required = [name for name in properties if name in schema.get("required", ())]
        optional = [name for name in properties if name not in required]

        # Few optional fields at once, so that one bad value does not hide what the others do.
        subsets = st.lists(st.sampled_from(optional), max_size=MAX_OPTIONAL_FIELDS, unique=True)

        @st.composite
        def fields(draw) -> dict[str, Any]:
            chosen = draw(subsets) if optional else []
            return {name: draw(self.values(properties[name])) for name in required + chosen}

        extra = schema.get("additionalProperties", not properties)
        if extra is False:
            return fields()
        extra_values = self.values(extra) if isinstance(extra, dict) else ANY_JSON
        extras = st.dictionaries(KEYS, extra_values, max_size=3)
        return st.tuples(extras, fields()).map(lambda pair: {**pair[0], **pair[1]})


def with_edges(values: SearchStrategy, edges: list[Any]) -> SearchStrategy:
    """``values``, or now and then one of ``edges`` (a fuzzer's dictionary)."""
    return values | st.sampled_from(edges) if edges else values


def within_bounds(value: float, schema: Schema) -> bool:
    """Whether ``value`` satisfies ``schema``'s minimum and maximum (exclusive or not)."""
    checks = (
        ("minimum", lambda bound: value >= bound),
        ("maximum", lambda bound: value <= bound),
        ("exclusiveMinimum", lambda bound: value > bound),
        ("exclusiveMaximum", lambda bound: value < bound),
    )
    return all(check(schema[key]) for key, check in checks if key in schema)


def integer_bounds(schema: Schema) -> tuple[Optional[int], Optional[int]]:
    """The least and greatest integer ``schema``'s minimum/maximum (exclusive or not) allow."""
    low, high = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        low = math.floor(schema["exclusiveMinimum"]) + 1
    if "exclusiveMaximum" in schema:
        high = math.ceil(schema["exclusiveMaximum"]) - 1
    return (None if low is None else math.ceil(low)), (None if high is None else math.floor(high))


def json_type(value: Any) -> str:
    """The JSON type name of a Python JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    names = {float: "number", str: "string", list: "array", dict: "object"}
    return names[type(value)]


KEYS = st.text(max_size=6)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)
# One value of each JSON type, for a field that does not accept that type.
VALUES_OF_TYPE = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(),
    "number": st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()),
    "string": st.text(max_size=8),
    "array": st.lists(SCALARS, max_size=2),
    "object": st.dictionaries(KEYS, SCALARS, max_size=2),
}


# --- requests and what their answers must be ---------------------------------------------------

Wrap = Callable[[Any], Any]  # puts a value where a field holds it: as is, in a list, ...


@dataclasses.dataclass(frozen=True)
class Probe:
    """One request, and what its answer may be on top of the properties every answer has."""

    route: str
    content: bytes
    content_type: Optional[str] = "application/json"
    statuses: frozenset[int] = ANY_STATUS
    bad_field: Optional[str] = None  # the one field at fault: a 400 must name it in ``param``

    def __repr__(self) -> str:
        content = self.content if len(self.content) <= 300 else self.content[:300] + b"..."
        return (
            f"Probe({self.route} {content!r} ({len(self.content)} bytes), "
            f"content_type={self.content_type!r}, statuses={sorted(self.statuses)}, "
            f"bad_field={self.bad_field!r})"
        )


def encode(value: Any) -> bytes:
    """``value`` as JSON with big integers exact and NaN/Infinity as raw tokens."""
    return json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


def with_raw(body: dict[str, Any], field: str, wrap: Wrap, raw: bytes) -> bytes:
    """``body`` with ``field`` set to ``wrap(x)`` and ``x`` replaced by the raw JSON ``raw``."""
    content = encode({**body, field: wrap(PLACEHOLDER)})
    return content.replace(encode(PLACEHOLDER), raw)


def describe(response: httpx.Response) -> str:
    """A response's status and (the start of) its body."""
    return f"{response.status_code} {response.text[:400]!r}"


def error_problem(error: Any) -> Optional[str]:
    """What is wrong with an OpenAI ``error`` object (None: nothing)."""
    if not isinstance(error, dict):
        return "the error is not an object"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(error.get("type"), str):
        return "error.type is not a string"
    missing = {"param", "code"} - set(error)
    return f"error has no {sorted(missing)}" if missing else None


def stream_problem(text: str) -> Optional[str]:
    """What is wrong with a server-sent event stream (None: nothing)."""
    lines = [line for line in text.split("\n") if line]
    if not lines or lines[-1] != "data: [DONE]":
        return "the stream does not end with data: [DONE]"
    for line in lines[:-1]:
        if not line.startswith("data: "):
            return f"not an SSE data line: {line[:80]!r}"
        try:
            chunk = json.loads(line.removeprefix("data: "))
        except ValueError:
            return f"an event is not JSON: {line[:80]!r}"
        if not isinstance(chunk, dict):
            return f"an event is not an object: {line[:80]!r}"
        if "error" in chunk:
            problem = error_problem(chunk["error"])
            if problem is None and chunk["error"].get("code") == "engine_dead":
                problem = "the stream reports the engine dead"
            if problem is not None:
                return problem
    return None


def success_problem(response: httpx.Response) -> Optional[str]:
    """What is wrong with a 200 (None: nothing)."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return stream_problem(response.text)
    try:
        body = response.json()
    except ValueError:
        return "the 200 body is not JSON"
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return "the 200 body has no choices"
    return None


def answer_problem(probe: Probe, response: httpx.Response) -> Optional[str]:
    """What is wrong with ``response`` as the answer to ``probe`` (None: nothing)."""
    status = response.status_code
    if status not in probe.statuses:
        return f"status {status} is not one of {sorted(probe.statuses)}"
    if status == 200:
        return success_problem(response)
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "the error body is not {'error': {...}}"
    problem = error_problem(error)
    if problem is not None:
        return problem
    if status == 503 and error["code"] != "queue_full":
        return f"a 503 with code {error['code']!r} (only queue_full may be a 503)"
    if status == 400 and probe.bad_field is not None and error["param"] != probe.bad_field:
        return f"param is {error['param']!r}, not the bad field {probe.bad_field!r}"
    return None


# --- a server that outlives its engine ----------------------------------------------------------


class LiveServer:
    """A real server over HTTP; one whose engine a request killed is replaced by a fresh one, so
    each request is judged on a live engine."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._start()

    def _start(self) -> None:
        self.server = self._factory()
        self.http = httpx.Client(base_url=self.server.base_url, timeout=HTTP_TIMEOUT_S)

    def close(self) -> None:
        self.http.close()

    def send(self, probe: Probe) -> httpx.Response:
        headers = {} if probe.content_type is None else {"content-type": probe.content_type}
        return self.http.post(probe.route, content=probe.content, headers=headers)

    def replace_if_dead(self) -> Optional[str]:
        """None while /health is 200; otherwise /health's answer, after starting a fresh server."""
        health = self.http.get("/health")
        if health.status_code == 200:
            return None
        self.close()
        self.server.stop()
        self._start()
        return describe(health)

    def judge(self, probe: Probe) -> Optional[str]:
        """Send ``probe``; what is wrong with how the server took it (None: nothing)."""
        response = self.send(probe)
        death = self.replace_if_dead()
        if death is not None:
            answer = describe(response)
            return f"the request killed the engine (/health: {death}); it was answered {answer}"
        problem = answer_problem(probe, response)
        return None if problem is None else f"{problem}; the answer: {describe(response)}"

    def assert_healthy_and_idle(self) -> None:
        """/health is 200 and the engine has no request and every KV block free."""
        health = self.http.get("/health")
        assert health.status_code == 200, describe(health)
        self.server.wait_idle()

    def schema_strategies(self, route: str) -> tuple[SchemaStrategies, Schema]:
        """Strategies over the published components, and ``route``'s published request schema."""
        document = self.http.get("/openapi.json").json()
        strategies = SchemaStrategies(document["components"]["schemas"])
        media = document["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        return strategies, strategies.resolve(media["schema"])


@pytest.fixture
def live(server_factory) -> Iterator[LiveServer]:
    """A server for one test, replaced whenever a request kills its engine."""
    running = LiveServer(server_factory)
    yield running
    running.close()


def assert_fine(live: LiveServer, probe: Probe) -> None:
    """``probe``'s answer has every property it must have, and the engine survived it."""
    problem = live.judge(probe)
    if problem is not None:
        pytest.fail(f"{probe!r}: {problem}")


# --- where numbers go in a request --------------------------------------------------------------


def numeric_places(strategies: SchemaStrategies, schema: Schema) -> dict[str, tuple[str, Wrap]]:
    """``label -> (field, wrap)``: each top-level field that holds a number, directly
    (``top_k``), as an array item (``prompt[]``) or as an object value (``logit_bias{}``)."""

    def numeric(item: Any) -> bool:
        types = strategies.json_types(item) if isinstance(item, dict) else JSON_TYPES
        return "integer" in types and types <= {"integer", "number", "null"}

    places = {}
    for field, prop in schema["properties"].items():
        if "integer" in strategies.json_types(prop):
            places[field] = (field, lambda value: value)
        for option in [strategies.resolve(option) for option in prop.get("anyOf", [prop])]:
            if option.get("type") == "array" and numeric(option.get("items", {})):
                places[f"{field}[]"] = (field, lambda value: [value])
            if option.get("type") == "object" and numeric(option.get("additionalProperties", {})):
                places[f"{field}{{}}"] = (field, lambda value: {"1": value})
    return places


def local_places(route: str) -> dict[str, tuple[str, Wrap]]:
    """``numeric_places`` of ``route``'s request model (as the server publishes it)."""
    schema = REQUEST_MODELS[route].model_json_schema()
    return numeric_places(SchemaStrategies(schema.get("$defs", {})), schema)


NUMERIC_CASES = [(route, label) for route in ROUTES for label in local_places(route)]
BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def published_bounds(route: str, field: str) -> list[Any]:
    """Each bound ``route``'s schema publishes for ``field`` (or its items), and for integers
    the values one past it: the largest accepted values do real work (n at its maximum forks
    that many samples), so they are edges too."""
    schema = REQUEST_MODELS[route].model_json_schema()
    strategies = SchemaStrategies(schema.get("$defs", {}))
    values = []
    for option in [
        strategies.resolve(o)
        for o in schema["properties"][field].get("anyOf", [schema["properties"][field]])
    ]:
        for numeric in (
            option,
            strategies.resolve(option.get("items", {})),
            strategies.resolve(option.get("additionalProperties", {}) or {}),
        ):
            for key in BOUND_KEYS:
                if key in numeric:
                    bound = numeric[key]
                    values += (
                        [bound, bound - 1, bound + 1]
                        if numeric.get("type") == "integer"
                        else [bound]
                    )
    return values


def edge_probe(route: str, field: str, wrap: Wrap, value: Any, stream: bool = False) -> Probe:
    """The base body with one numeric field at ``value``: a 200, or a 400 naming the field."""
    body = {**BASE_BODIES[route], **({"stream": True} if stream else {}), field: wrap(value)}
    return Probe(route, encode(body), statuses=frozenset({200, 400}), bad_field=field)


# --- the plain tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field, value", KNOWN_KILLERS, ids=[f"{f}={v}" for f, v in KNOWN_KILLERS])
def test_known_killer_is_a_400_naming_its_field(live, route, field, value):
    body = {**BASE_BODIES[route], field: value}
    assert_fine(live, Probe(route, encode(body), statuses=frozenset({400}), bad_field=field))
    live.assert_healthy_and_idle()


@pytest.mark.parametrize(
    "route, label", NUMERIC_CASES, ids=[f"{r}-{lab}" for r, lab in NUMERIC_CASES]
)
def test_numeric_field_at_edge_values_is_a_200_or_a_400_naming_it(live, route, label):
    field, wrap = local_places(route)[label]
    problems = []
    for value in (*EDGE_NUMBERS, *published_bounds(route, field)):
        problem = live.judge(edge_probe(route, field, wrap, value))
        if problem is not None:
            problems.append(f"{label} = {encode(value).decode()}: {problem}")
    if problems:
        pytest.fail("\n".join(problems))
    live.assert_healthy_and_idle()


# --- the property-based tests --------------------------------------------------------------------


def generated_bodies(strategies: SchemaStrategies, schema: Schema, route: str) -> SearchStrategy:
    """Bodies valid under ``route``'s published schema, with little work each: the length field
    set and small, ``n`` small, and ``model`` mostly the served one. A third are drawn whole; the
    rest are the base body with one or two fields drawn, so most reach the engine."""
    optional = sorted(set(schema["properties"]) - set(schema.get("required", ())))

    @st.composite
    def overlaid(draw) -> dict[str, Any]:
        fields = draw(st.lists(st.sampled_from(optional), min_size=1, max_size=2, unique=True))
        drawn = {field: draw(strategies.values(schema["properties"][field])) for field in fields}
        return {**BASE_BODIES[route], **drawn}

    @st.composite
    def bodies(draw) -> dict[str, Any]:
        whole = draw(st.integers(0, 2)) == 0
        body = draw(strategies.values(schema) if whole else overlaid())
        body[LENGTH_FIELDS[route]] = draw(SMALL_WORK[LENGTH_FIELDS[route]])
        for field, small in SMALL_WORK.items():
            if field in body:
                body[field] = draw(small)
        if "model" in body and draw(st.integers(0, 3)):
            body["model"] = MODEL_NAME
        return body

    return bodies()


def assert_all_fine(live: LiveServer, probes: SearchStrategy[Probe]) -> None:
    """Every probe ``probes`` draws (300, derandomized) is taken well; the server is healthy and
    idle after them."""

    @settings(max_examples=300, **FUZZ_SETTINGS)
    @given(probe=probes)
    def check(probe):
        assert_fine(live, probe)

    check()
    live.assert_healthy_and_idle()


@pytest.mark.parametrize("route", ROUTES)
def test_bodies_from_the_published_schema(live, route):
    strategies, schema = live.schema_strategies(route)
    assert_all_fine(
        live,
        generated_bodies(strategies, schema, route).map(lambda body: Probe(route, encode(body))),
    )


def mutated_requests(strategies: SchemaStrategies, schema: Schema, route: str) -> SearchStrategy:
    """Requests that break ``route``'s schema, or strain the server, in one way each."""
    valid = generated_bodies(strategies, schema, route)
    return st.one_of(
        wrong_types(strategies, schema, route, valid),
        missing_required_fields(schema, route, valid),
        edge_numbers(strategies, schema, route),
        odd_strings(strategies, schema, route),
        huge_values(route),
        deep_nesting(schema, route),
        broken_json(route, valid),
        non_objects(route),
        other_content_types(route, valid),
        unknown_fields(route, valid),
    )


def wrong_types(strategies, schema, route, valid) -> SearchStrategy[Probe]:
    """A valid body with one field of a JSON type its schema does not accept: a 400 naming it."""
    choices = [
        (field, sorted(JSON_TYPES - strategies.json_types(prop)))
        for field, prop in schema["properties"].items()
        if strategies.json_types(prop) != JSON_TYPES
    ]

    @st.composite
    def probes(draw) -> Probe:
        body = draw(valid)
        field, wrong = draw(st.sampled_from(choices))
        body[field] = draw(VALUES_OF_TYPE[draw(st.sampled_from(wrong))])
        return Probe(route, encode(body), statuses=frozenset({400}), bad_field=field)

    return probes()


def missing_required_fields(schema, route, valid) -> SearchStrategy[Probe]:
    """A valid body without one required field: a 400 naming it."""

    def without(body: dict[str, Any], field: str) -> Probe:
        rest = {key: value for key, value in body.items() if key != field}
        return Probe(route, encode(rest), statuses=frozenset({400}), bad_field=field)

    return st.builds(without, valid, st.sampled_from(sorted(schema["required"])))


def edge_numbers(strategies, schema, route) -> SearchStrategy[Probe]:
    """The base body with one numeric field at an edge value, maybe streamed."""
    places = numeric_places(strategies, schema)
    numbers = st.sampled_from(EDGE_NUMBERS) | st.integers() | st.floats()

    def probe(label: str, value: Any, stream: bool) -> Probe:
        field, wrap = places[label]
        return edge_probe(route, field, wrap, value, stream)

    return st.builds(probe, st.sampled_from(sorted(places)), numbers, st.booleans())


def text_places(strategies, schema, route) -> dict[str, Wrap]:
    """``field -> wrap`` for each field that holds text (chat text goes in a message)."""
    places = {}
    for field, prop in schema["properties"].items():
        if "string" in strategies.json_types(prop):
            places[field] = lambda text: text
    if route == CHAT:
        places["messages"] = lambda text: [{"role": "user", "content": text}]
    return places


def odd_strings(strategies, schema, route) -> SearchStrategy[Probe]:
    """The base body with one text field odd: unicode, huge, or raw surrogates and bad UTF-8."""
    places = text_places(strategies, schema, route)
    fields = st.sampled_from(sorted(places))
    huge = st.sampled_from(["x" * 200_000, "😀" * 20_000])
    texts = st.sampled_from(ODD_TEXT) | st.text(max_size=64) | huge

    def text_probe(field: str, text: str) -> Probe:
        return Probe(route, encode({**BASE_BODIES[route], field: places[field](text)}))

    def raw_probe(field: str, raw: bytes) -> Probe:
        content = with_raw(BASE_BODIES[route], field, places[field], b'"a' + raw + b'b"')
        return Probe(route, content)

    raws = st.sampled_from(ODD_STRING_BYTES)
    return st.builds(text_probe, fields, texts) | st.builds(raw_probe, fields, raws)


def huge_values(route) -> SearchStrategy[Probe]:
    """The base body with one field huge (work stays small: no huge batch of prompts)."""
    huge = {
        "stop": ["x"] * 10_000,
        "stop_token_ids": [1] * 100_000,
        "logit_bias": {str(token): 1.0 for token in range(10_000)},
    }
    if route == COMPLETIONS:
        huge["prompt"] = [1] * 100_000
    else:
        huge["messages"] = [{"role": "user", "content": "hi"}] * 10_000

    def probe(field: str) -> Probe:
        return Probe(route, encode({**BASE_BODIES[route], field: huge[field]}))

    return st.builds(probe, st.sampled_from(sorted(huge)))


def deep_nesting(schema, route) -> SearchStrategy[Probe]:
    """A field, or the whole body, nested ``depth`` arrays or objects deep."""

    def nested(kind: str, depth: int) -> bytes:
        if kind == "array":
            return b"[" * depth + b"]" * depth
        return b'{"a":' * depth + b"1" + b"}" * depth

    def probe(field: Optional[str], kind: str, depth: int) -> Probe:
        if field is None:
            return Probe(route, nested(kind, depth), statuses=frozenset({400}))
        return Probe(route, with_raw(BASE_BODIES[route], field, lambda x: x, nested(kind, depth)))

    fields = st.none() | st.sampled_from(sorted(schema["properties"]))
    return st.builds(probe, fields, st.sampled_from(["array", "object"]), st.sampled_from(DEPTHS))


def broken_json(route, valid) -> SearchStrategy[Probe]:
    """Truncated valid bodies (a 400), malformed JSON and random bytes."""

    @st.composite
    def truncated(draw) -> Probe:
        content = encode(draw(valid))
        cut = draw(st.integers(0, len(content) - 1))
        return Probe(route, content[:cut], statuses=frozenset({400}))

    malformed = st.sampled_from(BROKEN_JSON).map(lambda content: Probe(route, content))
    garbage = st.binary(max_size=64).map(lambda content: Probe(route, content))
    return truncated() | malformed | garbage


def non_objects(route) -> SearchStrategy[Probe]:
    """A JSON body that is not an object: a 400."""
    values = ANY_JSON.filter(lambda value: not isinstance(value, dict))
    return values.map(lambda value: Probe(route, encode(value), statuses=frozenset({400})))


def other_content_types(route, valid) -> SearchStrategy[Probe]:
    """A valid body sent with another content type, or none."""

    def probe(body: dict[str, Any], content_type: Optional[str]) -> Probe:
        return Probe(route, encode(body), content_type=content_type)

    return st.builds(probe, valid, st.sampled_from(CONTENT_TYPES))


def unknown_fields(route, valid) -> SearchStrategy[Probe]:
    """A valid body with fields no schema names (they are ignored)."""

    def probe(body: dict[str, Any], extra: dict[str, Any]) -> Probe:
        return Probe(route, encode({**extra, **body}))

    extras = st.dictionaries(st.text(min_size=1, max_size=8), ANY_JSON, min_size=1, max_size=3)
    return st.builds(probe, valid, extras)


@pytest.mark.parametrize("route", ROUTES)
def test_mutated_requests(live, route):
    strategies, schema = live.schema_strategies(route)
    assert_all_fine(live, mutated_requests(strategies, schema, route))
