"""Round-trips, validation rules and the registry of engine.protocol.codec."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar, Literal

import msgspec
import pytest
from hypothesis import given
from protocol_strategies import FAST, all_messages, pack, wire

from engine.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    REFUSAL_REASONS,
    ChatMessage,
    ErrorReply,
    GenerateRequest,
    ProtocolError,
    Refusal,
    SamplingParams,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
    decode,
    encode,
    register,
    registered,
)
from engine.protocol.base import Message

# ---------------------------------------------------------------- round trips


def _same_types(a: object, b: object) -> None:
    """Equal is not enough: 1 == 1.0 and (1,) != [1] hide type drift."""
    assert type(a) is type(b)
    if isinstance(a, msgspec.Struct):
        for f in msgspec.structs.fields(a):
            _same_types(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _same_types(x, y)


@FAST
@given(all_messages)
def test_every_message_round_trips(msg: object) -> None:
    data = encode(msg)
    back = decode(data)
    assert back == msg
    _same_types(back, msg)
    assert encode(back) == data  # deterministic bytes


def test_all_message_classes_are_registered() -> None:
    kinds = set(registered())
    assert {"chat_message", "sampling_params", "generate_request", "usage", "timings",
            "token_event", "error_reply", "tensor_spec", "framed_header"} <= kinds


def test_envelope_shape_and_nested_plain_maps() -> None:
    req = GenerateRequest("r", messages=(ChatMessage("user", "hi"),))
    env = wire(req)
    assert env["v"] == PROTOCOL_VERSION and env["k"] == "generate_request"
    assert env["b"]["messages"] == [{"role": "user", "content": "hi", "tool_calls": [],
                                     "tool_call_id": None}]  # tuple -> array
    assert env["b"]["sampling"]["stop"] == []


def test_int_for_float_is_converted() -> None:
    env = wire(SamplingParams())
    env["b"]["temperature"] = 1
    back = decode(pack(env))
    assert back.temperature == 1.0 and type(back.temperature) is float
    assert type(SamplingParams(temperature=1).temperature) is float


def test_import_is_light() -> None:
    code = ("import sys, engine.protocol; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or (m.startswith('engine.') and not m.startswith('engine.protocol'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- message rules

# The rules types cannot say. A message breaking one cannot be built -- or, for the
# classes built for every token (TokenEvent, TokenLogprob), cannot be sent: their rules
# run where they cross the wire. A value of the wrong type is the wire's to refuse
# (BAD_WIRE below: msgspec checks every field's type on decode) and mypy's in code.
INVALID_MESSAGES = {
    "role": lambda: ChatMessage("robot", "x"),
    "role_type": lambda: ChatMessage(1, "x"),
    "content_long": lambda: ChatMessage("user", "x" * 1_000_001),
    "max_tokens_zero": lambda: SamplingParams(max_tokens=0),
    "max_tokens_big": lambda: SamplingParams(max_tokens=1_000_001),
    "temperature_neg": lambda: SamplingParams(temperature=-0.1),
    "temperature_nan": lambda: SamplingParams(temperature=math.nan),
    "temperature_big": lambda: SamplingParams(temperature=100.5),
    "top_p_zero": lambda: SamplingParams(top_p=0.0),
    "top_p_over": lambda: SamplingParams(top_p=1.01),
    "top_p_nan": lambda: SamplingParams(top_p=math.nan),
    "top_k_neg": lambda: SamplingParams(top_k=-1),
    "rep_zero": lambda: SamplingParams(repetition_penalty=0.0),
    "rep_inf": lambda: SamplingParams(repetition_penalty=math.inf),
    "seed_neg": lambda: SamplingParams(seed=-1),
    "seed_big": lambda: SamplingParams(seed=2**63),
    "stop_empty_str": lambda: SamplingParams(stop=("",)),
    "stop_too_many": lambda: SamplingParams(stop=tuple("abcdefghijklmnopq")),
    "stop_too_long": lambda: SamplingParams(stop=("x" * 257,)),
    "both_messages_and_prompt": lambda: GenerateRequest(
        "r", messages=(ChatMessage("user", "x"),), prompt="x"),
    "neither_messages_nor_prompt": lambda: GenerateRequest("r"),
    "empty_messages": lambda: GenerateRequest("r", messages=()),
    "request_id_empty": lambda: GenerateRequest("", prompt="x"),
    "request_id_long": lambda: GenerateRequest("r" * 129, prompt="x"),
    "usage_neg": lambda: Usage(-1, 0),
    "timings_neg": lambda: Timings(0.0, -1.0, 0.0, 0.0),
    "timings_nan": lambda: Timings(0.0, 0.0, math.nan, 0.0),
    "event_finish": lambda: TokenEvent("r", finish_reason="done"),
    "event_error_without_finish": lambda: TokenEvent("r", error="boom"),
    "event_error_with_stop": lambda: TokenEvent("r", finish_reason="stop", error="boom"),
    "event_finish_error_without_reason": lambda: TokenEvent("r", finish_reason="error"),
    "event_usage_not_final": lambda: TokenEvent("r", usage=Usage(1, 1)),
    "event_timings_not_final": lambda: TokenEvent("r", timings=Timings(0, 0, 0, 0)),
    "event_token_neg": lambda: TokenEvent("r", token_ids=(-1,)),
    "event_token_big": lambda: TokenEvent("r", token_ids=(2**31,)),
    "event_request_id_empty": lambda: TokenEvent("", text="x"),
    "event_error_code_without_error": lambda: TokenEvent("r", finish_reason="stop", error_code="engine"),
    "event_logprobs_mismatch": lambda: TokenEvent("r", token_ids=(1,), logprobs=(TokenLogprob(2, "b", -0.5),)),
    "event_logprob_positive": lambda: TokenEvent("r", token_ids=(1,), logprobs=(TokenLogprob(1, "a", 0.5),)),
    "logprob_nan": lambda: TokenLogprob(1, "a", math.nan),
    "logprob_top_lengths": lambda: TokenLogprob(1, "a", -0.1, top_ids=(1, 2), top_texts=("a",),
                                                top_logprobs=(-0.1, -0.2)),
    "reply_code": lambda: ErrorReply(None, "nope", "x"),
    "reply_request_id": lambda: ErrorReply("", "internal", "x"),
    "reply_refused_without_refusal": lambda: ErrorReply("r", "refused", "x"),
    "reply_refusal_with_other_code": lambda: ErrorReply("r", "overloaded", "x", Refusal("cpu_busy")),
    "refusal_reason_unknown": lambda: Refusal("tired"),
    "refusal_reason_type": lambda: Refusal(None),
    "refusal_need_negative": lambda: Refusal("ram", -1, 0),
    "refusal_limit_negative": lambda: Refusal("disk", 10, -1),
    "refusal_need_over_64_bits": lambda: Refusal("disk", 2**63, 0),
    "refusal_bytes_on_a_reason_without_bytes": lambda: Refusal("device", 5, 0),
}


@pytest.mark.parametrize("make", INVALID_MESSAGES.values(), ids=INVALID_MESSAGES.keys())
def test_invalid_message_cannot_be_built_or_sent(make) -> None:
    with pytest.raises(ProtocolError):
        encode(make())


def test_valid_edges_are_accepted() -> None:
    for msg in (SamplingParams(max_tokens=1, top_p=1.0, temperature=100, repetition_penalty=100,
                               seed=2**63 - 1, stop=tuple("abcdefghijklmnop")),
                TokenEvent("r", finish_reason="error", error="boom"),
                TokenEvent("r", finish_reason="cancelled"),
                TokenEvent("r", token_ids=(1,), logprobs=(TokenLogprob(1, "a", -0.5, (1, 2), ("a", "b"),
                                                                       (-0.5, -2.0)),))):
        assert decode(encode(msg)) == msg


def test_per_token_events_check_their_rules_on_the_wire_only() -> None:
    """An engine builds a TokenEvent for every token: building one checks nothing (an
    error still gets its code); encoding or decoding one checks every rule."""
    bad = TokenEvent("", token_ids=(-1,))  # built: nothing checked on the hot path
    with pytest.raises(ProtocolError) as info:
        encode(bad)
    assert str(info.value).startswith("token_event: ") and info.value.code == "malformed"
    assert TokenEvent("r", finish_reason="error", error="boom").error_code == "engine"
    with pytest.raises(ProtocolError):
        bad.validate()


# ---------------------------------------------------------------- wire rules


def _event() -> TokenEvent:
    return TokenEvent("r", "hi", (1, 2), "stop", Usage(3, 2), Timings(0.0, 0.1, 0.2, 10.0))


def _refused() -> ErrorReply:
    return ErrorReply("r", "refused", "needs 3.1 GB", Refusal("policy_cap", 3_100_000_000, 2_000_000_000))


def _req() -> GenerateRequest:
    return GenerateRequest("r", messages=(ChatMessage("user", "hi"),),
                           sampling=SamplingParams(stop=("x",)))


def _tamper(msg, edit):
    env = wire(msg)
    edit(env)
    return pack(env)


def _set(path, value):
    def edit(env):
        node = env
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _drop(path):
    def edit(env):
        node = env
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


BAD_WIRE = {
    "unknown_kind": (_req, _set(["k"], "launch_missiles"), "unknown_kind"),
    "kind_not_str": (_req, _set(["k"], 7), "malformed"),
    "version_next": (_req, _set(["v"], PROTOCOL_VERSION + 1), "version"),
    "version_previous": (_req, _set(["v"], PROTOCOL_VERSION - 1), "version"),
    "version_0": (_req, _set(["v"], 0), "version"),
    "version_bool": (_req, _set(["v"], True), "version"),
    "version_str": (_req, _set(["v"], str(PROTOCOL_VERSION)), "version"),
    "envelope_extra": (_req, _set(["x"], 1), "malformed"),
    "envelope_missing": (_req, _drop(["b"]), "malformed"),
    "body_not_map": (_req, _set(["b"], [1, 2]), "malformed"),
    "missing_field": (_req, _drop(["b", "prompt"]), "malformed"),
    "extra_field": (_req, _set(["b", "priority"], 1), "malformed"),
    "nested_missing": (_req, _drop(["b", "sampling", "seed"]), "malformed"),
    "nested_extra": (_req, _set(["b", "sampling", "min_p"], 0.1), "malformed"),
    "nested_in_array_missing": (_req, _drop(["b", "messages", 0, "tool_call_id"]), "malformed"),
    "nested_in_array_extra": (_req, _set(["b", "messages", 0, "name"], "bob"), "malformed"),
    "nested_not_map": (_req, _set(["b", "sampling"], 5), "malformed"),
    "bool_for_int": (_req, _set(["b", "sampling", "max_tokens"], True), "malformed"),
    "float_for_int": (_req, _set(["b", "sampling", "max_tokens"], 5.0), "malformed"),
    "bool_for_float": (_req, _set(["b", "sampling", "top_p"], True), "malformed"),
    "str_for_float": (_req, _set(["b", "sampling", "top_p"], "1"), "malformed"),
    "nan_top_p": (_req, _set(["b", "sampling", "top_p"], math.nan), "malformed"),
    "inf_temperature": (_req, _set(["b", "sampling", "temperature"], math.inf), "malformed"),
    "big_int_top_p": (_req, _set(["b", "sampling", "top_p"], 2**64 - 1), "malformed"),
    "bin_for_str": (_req, _set(["b", "request_id"], b"r"), "malformed"),
    "role_invalid": (_req, _set(["b", "messages", 0, "role"], "root"), "malformed"),
    "messages_map": (_req, _set(["b", "messages"], {"role": "user"}), "malformed"),
    "messages_empty": (_req, _set(["b", "messages"], []), "malformed"),
    "both_prompt": (_req, _set(["b", "prompt"], "x"), "malformed"),
    "stop_item_int": (_req, _set(["b", "sampling", "stop"], [1]), "malformed"),
    "stop_str": (_req, _set(["b", "sampling", "stop"], "x"), "malformed"),
    "max_tokens_zero": (_req, _set(["b", "sampling", "max_tokens"], 0), "malformed"),
    "event_error_pairing": (_event, _set(["b", "error"], "boom"), "malformed"),
    "event_finish": (_event, _set(["b", "finish_reason"], "halt"), "malformed"),
    "event_token_neg": (_event, _set(["b", "token_ids"], [-5]), "malformed"),
    "event_usage_wrong": (_event, _set(["b", "usage"], [3, 2]), "malformed"),
    "event_timing_nan": (_event, _set(["b", "timings", "ttft_s"], math.nan), "malformed"),
    "event_timing_str": (_event, _set(["b", "timings", "ttft_s"], "0"), "malformed"),
    "event_not_final_usage": (_event, _set(["b", "finish_reason"], None), "malformed"),
    "refusal_reason_unknown": (_refused, _set(["b", "refusal", "reason"], "tired"), "malformed"),
    "refusal_need_negative": (_refused, _set(["b", "refusal", "need_bytes"], -1), "malformed"),
    "refusal_limit_negative": (_refused, _set(["b", "refusal", "limit_bytes"], -3), "malformed"),
    "refusal_need_float": (_refused, _set(["b", "refusal", "need_bytes"], 3.0), "malformed"),
    "refusal_need_str": (_refused, _set(["b", "refusal", "need_bytes"], "3 GB"), "malformed"),
    "refusal_missing": (_refused, _drop(["b", "refusal"]), "malformed"),
    "refusal_field_missing": (_refused, _drop(["b", "refusal", "limit_bytes"]), "malformed"),
    "refusal_field_extra": (_refused, _set(["b", "refusal", "used_bytes"], 1), "malformed"),
    "refusal_nil_when_refused": (_refused, _set(["b", "refusal"], None), "malformed"),
    "refusal_with_other_code": (_refused, _set(["b", "code"], "overloaded"), "malformed"),
    # values of the wrong type (built in code, these are mypy's to catch)
    "role_int": (_req, _set(["b", "messages", 0, "role"], 1), "malformed"),
    "content_bin": (_req, _set(["b", "messages", 0, "content"], b"x"), "malformed"),
    "messages_item_str": (_req, _set(["b", "messages"], ["hi"]), "malformed"),
    "usage_bool": (_event, _set(["b", "usage", "prompt_tokens"], True), "malformed"),
    "event_token_bool": (_event, _set(["b", "token_ids"], [True, 2]), "malformed"),
    "event_token_float": (_event, _set(["b", "token_ids"], [1.0, 2]), "malformed"),
    "reply_message_nil": (_refused, _set(["b", "message"], None), "malformed"),
    "refusal_str": (_refused, _set(["b", "refusal"], "ram"), "malformed"),
    "refusal_reason_nil": (_refused, _set(["b", "refusal", "reason"], None), "malformed"),
    "refusal_need_bool": (_refused, _set(["b", "refusal", "need_bytes"], True), "malformed"),
    "refusal_need_over_64_bits": (_refused, _set(["b", "refusal", "need_bytes"], 2**64 - 1), "malformed"),
}


@pytest.mark.parametrize("make, edit, code", BAD_WIRE.values(), ids=BAD_WIRE.keys())
def test_bad_wire_input_is_rejected(make, edit, code) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(_tamper(make(), edit))
    assert info.value.code == code
    assert "\n" not in str(info.value) and str(info.value)


@pytest.mark.parametrize("data, code", [
    (b"", "malformed"),
    (b"\xc1", "malformed"),  # never-used msgpack byte
    (pack([1, 2, 3]), "malformed"),  # envelope not a map
    (pack("hello"), "malformed"),
    (pack(None), "malformed"),
    (pack({1: 2}), "malformed"),  # non-str map key
    (b"\xd6\xff\x00\x00\x00\x00", "malformed"),  # msgpack timestamp extension
    (b"\xc7\x00\x05", "malformed"),  # empty extension
    (b"\xa2\xff\xfe", "malformed"),  # invalid UTF-8
])
def test_garbage_is_rejected(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert info.value.code == code


def test_trailing_garbage_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="trailing"):
        decode(encode(_req()) + b"\x00")


def test_non_bytes_input_is_rejected() -> None:
    for bad in (None, "text", 5, [1]):
        with pytest.raises(ProtocolError):
            decode(bad)
    assert decode(bytearray(encode(_req()))) == _req()
    assert decode(memoryview(encode(_req()))) == _req()


def test_oversize_input_is_rejected_before_unpacking() -> None:
    big = b"\xc0" * (MAX_MESSAGE_BYTES + 1)
    with pytest.raises(ProtocolError) as info:
        decode(big)
    assert info.value.code == "too_large"
    with pytest.raises(ProtocolError) as info:
        decode(encode(_req()), max_bytes=10)
    assert info.value.code == "too_large"


def test_oversize_message_is_not_encoded() -> None:
    with pytest.raises(ProtocolError) as info:
        encode(GenerateRequest("r", prompt="x" * 1000), max_bytes=100)
    assert info.value.code == "too_large"


def test_encode_rejects_unregistered_objects() -> None:
    @dataclass(frozen=True)
    class Stray:
        KIND: ClassVar[str] = "stray"
        x: int

    for bad in (Stray(1), {"v": 1}, None, "x"):
        with pytest.raises(ProtocolError):
            encode(bad)


def test_encode_rejects_unencodable_strings() -> None:
    with pytest.raises(ProtocolError):
        encode(ChatMessage("user", "\ud800"))  # lone surrogate: no UTF-8 form


def test_error_reply_from_exception() -> None:
    e = ProtocolError("bad\nthing " + "x" * 5000, "version")
    assert "\n" not in str(e) and len(str(e)) <= 300
    reply = ErrorReply.from_exception(e, "r1")
    assert reply.code == "version" and reply.request_id == "r1"
    hidden = ErrorReply.from_exception(RuntimeError("/secret/path"), "")
    assert hidden == ErrorReply(None, "internal", "internal error")
    assert decode(encode(reply)) == reply and reply.refusal is None
    assert ProtocolError("x", "not-a-code").code == "malformed"


def test_a_refusal_travels_as_fields() -> None:
    """A peer that will not take work says why in fields a program branches on;
    the message stays the line for people."""
    e = ProtocolError("needs 3.10 GB but the RAM limit of 2 GB leaves 2.00 GB",
                      refusal=Refusal("policy_cap", 3_100_000_000, 2_000_000_000))
    assert e.code == "refused" and e.refusal.shortfall_bytes == 1_100_000_000
    reply = ErrorReply.from_exception(e, "r1")
    back = decode(encode(reply))
    assert back == reply and back.code == "refused" and back.message == str(e)
    assert back.refusal == Refusal("policy_cap", 3_100_000_000, 2_000_000_000)
    assert wire(reply)["b"]["refusal"] == {"reason": "policy_cap", "need_bytes": 3_100_000_000,
                                           "limit_bytes": 2_000_000_000}
    assert wire(ErrorReply("r", "internal", "x"))["b"]["refusal"] is None
    for reason in REFUSAL_REASONS:  # every documented reason is accepted and round-trips
        counts = (7, 5) if reason in ("policy_cap", "ram", "disk") else (0, 0)
        r = ErrorReply(None, "refused", reason, Refusal(reason, *counts))
        assert decode(encode(r)) == r
    assert REFUSAL_REASONS == ("not_sharing", "device", "policy_cap", "ram", "cpu_busy", "disk")
    with pytest.raises(TypeError):  # "refused" without the fields is a bug in the caller, loudly
        ProtocolError("no", "refused")


# ---------------------------------------------------------------- registry


class _Inner(Message):
    KIND: ClassVar[str] = "test_inner"
    x: float  # any float


@register
class _Probe(Message):
    KIND: ClassVar[str] = "test_probe"
    blob: bytes  # raw bytes travel as msgpack bin
    pair: tuple[int, str]  # fixed-length tuple
    either: int | str  # first matching arm wins
    mode: Literal["a", "b"]  # a closed set
    maybe: _Inner | None  # nested message, optional
    flag: bool = False  # a plain bool


def test_generic_converter_handles_other_modules_types() -> None:
    probe = _Probe(b"\x00\xff", (1, "a"), "s", "b", _Inner(2.5), True)
    assert decode(encode(probe)) == probe
    probe2 = _Probe(b"", (0, ""), 7, "a", None)
    assert decode(encode(probe2)) == probe2
    for field_, value in [("pair", [1]), ("pair", [1, 2]), ("either", 1.5), ("mode", "c"),
                          ("mode", True), ("blob", "text"), ("maybe", {"x": "1"}),
                          ("flag", 1)]:
        env = wire(probe)
        env["b"][field_] = value
        with pytest.raises(ProtocolError):
            decode(pack(env))


class _Lenient(msgspec.Struct, frozen=True):  # would ignore unknown fields
    KIND: ClassVar[str] = "test_lenient"
    x: int


class _NestedLenient(Message):  # strict itself, but not what it holds
    KIND: ClassVar[str] = "test_nested_lenient"
    x: _Lenient


def test_register_rejects_bad_classes() -> None:
    class Dup(Message):
        KIND: ClassVar[str] = "chat_message"
        x: int

    class Mutable(msgspec.Struct, forbid_unknown_fields=True):
        KIND: ClassVar[str] = "test_mutable"
        x: int

    class NoKind(Message):
        x: int

    class DictField(Message):  # mutable, unhashable: no wire form
        KIND: ClassVar[str] = "test_dict_field"
        x: dict

    class Positional(Message, array_like=True):  # an array, not a map of named fields
        KIND: ClassVar[str] = "test_positional"
        x: int

    @dataclass(frozen=True)
    class NotAStruct:
        KIND: ClassVar[str] = "test_not_a_struct"
        x: int

    for cls in (Dup, Mutable, _Lenient, NoKind, DictField, Positional, _NestedLenient, NotAStruct, int):
        with pytest.raises(TypeError):
            register(cls)
    assert not {"test_dict_field", "test_lenient", "test_positional", "test_nested_lenient"} & set(registered())
    assert register(ChatMessage) is ChatMessage  # idempotent


def test_agent_up_line_round_trip_and_refusals():
    """The agent's announce line (engine.protocol.control.AgentUp): fields in, fields out; any
    other line is not it; a line that claims to be it with bad fields is a ProtocolError."""
    from engine.protocol.control import AgentUp

    up = AgentUp("0" * 32, 7000, 7001, 7002)
    assert AgentUp.from_line(up.line()) == up and AgentUp.from_line(up.line() + "\n") == up
    assert AgentUp.from_line("agent 0000 up: control 7000, pairing 7001, info 7002") is None  # a log line
    assert AgentUp.from_line('{"event": "bound", "endpoint": "tcp://x:1"}') is None
    with pytest.raises(ProtocolError):
        AgentUp.from_line('{"event": "agent_up", "node_id": "' + "0" * 32 + '", "control_port": 0, '
                          '"pair_port": 1, "info_port": 2}')
    with pytest.raises(ProtocolError):
        AgentUp.from_line('{"event": "agent_up", "node_id": "x"}')
