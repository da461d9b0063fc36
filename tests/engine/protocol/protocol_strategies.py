"""Hypothesis strategies for VALID protocol messages, built from the field
constraints in engine.protocol.messages / frames (not from the validators, so a
validator that got stricter than its documented rule shows up as a failure)."""

from __future__ import annotations

import json
import math

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from engine.protocol import (
    DTYPES,
    EVENT_ERROR_CODES,
    FINISH_REASONS,
    ROLES,
    ChatMessage,
    ErrorReply,
    FramedHeader,
    GenerateRequest,
    SamplingParams,
    TensorSpec,
    Timings,
    TokenEvent,
    ToolCall,
    ToolSpec,
    Usage,
    encode,
)
from engine.protocol.errors import BYTE_REASONS, ERROR_CODES, REFUSAL_REASONS, Refusal
from engine.protocol.messages import MAX_NEW_TOKENS, MAX_TOKEN_ID

# Fast, reproducible, no example database written into the shared tree.
FAST = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# Lone surrogates cannot be UTF-8 encoded, so no peer can ever send one.
_chars = st.characters(exclude_categories=("Cs",))
text = st.text(alphabet=_chars, max_size=40)
ids = st.text(alphabet=_chars, min_size=1, max_size=128)
finite = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)

tool_names = st.from_regex(r"\A[A-Za-z0-9_-]{1,64}\Z")
json_objects = st.dictionaries(st.text(alphabet=_chars, max_size=8), st.integers() | text, max_size=3).map(
    lambda d: json.dumps({"type": "object", **({"properties": {k: {"const": v} for k, v in d.items()}} if d else {})}))
tool_specs = st.builds(ToolSpec, name=tool_names, description=text, parameters=json_objects)
tool_calls = st.builds(ToolCall, id=ids, name=tool_names, arguments=text)


@st.composite
def chat_messages(draw: st.DrawFn) -> ChatMessage:
    role = draw(st.sampled_from(ROLES))
    calls = tuple(draw(st.lists(tool_calls, max_size=2))) if role == "assistant" else ()
    return ChatMessage(role, draw(text), tool_calls=calls, tool_call_id=draw(ids) if role == "tool" else None)


sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, MAX_NEW_TOKENS),
    temperature=st.floats(0.0, 100.0) | st.integers(0, 100),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(0, MAX_TOKEN_ID),
    repetition_penalty=st.floats(0.0, 100.0, exclude_min=True),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(alphabet=_chars, min_size=1, max_size=256), max_size=16).map(tuple),
)


@st.composite
def generate_requests(draw: st.DrawFn) -> GenerateRequest:
    rid = draw(ids)
    sampling = draw(sampling_params)
    if draw(st.booleans()):
        msgs = draw(st.lists(chat_messages(), min_size=1, max_size=5))
        tools = draw(st.lists(tool_specs, max_size=3, unique_by=lambda t: t.name))
        choice = draw(st.sampled_from(("auto", "none", "required") if tools else ("auto", "none")))
        forced = draw(st.none() | st.sampled_from([t.name for t in tools])) if choice == "required" else None
        schema = draw(st.none() | json_objects) if choice != "required" else None
        return GenerateRequest(rid, messages=tuple(msgs), sampling=sampling, tools=tuple(tools), tool_choice=choice,
                               forced_tool=forced, json_schema=schema)
    return GenerateRequest(rid, prompt=draw(text), sampling=sampling)


usages = st.builds(Usage, prompt_tokens=st.integers(0, 2**63 - 1),
                   completion_tokens=st.integers(0, 2**63 - 1))
timings = st.builds(Timings, queued_s=finite, ttft_s=finite, total_s=finite, decode_tok_s=finite)


@st.composite
def token_events(draw: st.DrawFn) -> TokenEvent:
    finish = draw(st.none() | st.sampled_from(FINISH_REASONS))
    final = finish is not None
    return TokenEvent(
        request_id=draw(ids),
        text=draw(text),
        token_ids=tuple(draw(st.lists(st.integers(0, MAX_TOKEN_ID), max_size=8))),
        finish_reason=finish,
        usage=draw(st.none() | usages) if final else None,
        timings=draw(st.none() | timings) if final else None,
        error=draw(st.text(alphabet=_chars, max_size=100)) if finish == "error" else None,
        error_code=draw(st.none() | st.sampled_from(EVENT_ERROR_CODES)) if finish == "error" else None,
    )


@st.composite
def refusals(draw: st.DrawFn) -> Refusal:
    reason = draw(st.sampled_from(REFUSAL_REASONS))
    if reason not in BYTE_REASONS:  # only the byte reasons carry counts
        return Refusal(reason)
    counts = st.integers(0, 2**63 - 1)
    return Refusal(reason, draw(counts), draw(counts))


@st.composite
def error_replies(draw: st.DrawFn) -> ErrorReply:
    code = draw(st.sampled_from(ERROR_CODES))
    return ErrorReply(draw(st.none() | ids), code, draw(st.text(alphabet=_chars, max_size=100)),
                      draw(refusals()) if code == "refused" else None)


@st.composite
def tensor_specs(draw: st.DrawFn) -> TensorSpec:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 64), max_size=4)))
    return TensorSpec(dtype, shape, math.prod(shape) * DTYPES[dtype].itemsize)


plain_messages = st.one_of(chat_messages(), tool_specs, tool_calls, sampling_params, generate_requests(), usages,
                           timings, token_events(), error_replies(), refusals())


@st.composite
def framed_headers(draw: st.DrawFn) -> FramedHeader:
    payload = encode(draw(plain_messages))
    return FramedHeader(payload, tuple(draw(st.lists(tensor_specs(), max_size=4))))


all_messages = st.one_of(plain_messages, tensor_specs(), framed_headers())

# Arbitrary msgpack-able data, nested: what a confused or hostile peer sends.
wire_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(), st.text(alphabet=_chars, max_size=20), st.binary(max_size=20),
)
wire_objects = st.recursive(
    wire_scalars,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(alphabet=_chars, max_size=12), inner, max_size=5),
    max_leaves=20,
)


def wire(msg: object) -> dict:
    """The envelope of msg as plain data, for tests that tamper with it."""
    return msgpack.unpackb(encode(msg), raw=False)


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)
