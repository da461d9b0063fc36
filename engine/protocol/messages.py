"""Messages of the generation API: what a chat, the CLI or the HTTP API send
to an engine, and the events an engine streams back.

Every message is a frozen msgspec Struct (engine.protocol.base). The request
side -- GenerateRequest and its parts, built once per request -- checks its
rules when built, so an invalid one cannot exist (the HTTP API answers a
ProtocolError with a 400). The answer side -- TokenEvent and TokenLogprob, built
for every token inside an engine -- checks its rules in validate(), which the
codec runs when one crosses the wire (engine.protocol.codec), so the per-token
path pays nothing. The codec turns them all into bytes.
"""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

import msgspec
from msgspec.structs import force_setattr

from engine.protocol._checks import in_range as _in_range
from engine.protocol._checks import is_text as _is_text
from engine.protocol._checks import require as _require
from engine.protocol._checks import set_float as _set_float
from engine.protocol.base import Message
from engine.protocol.errors import (
    ERROR_CODES,
    ErrorCode,
    ProtocolError,
    Refusal,
    one_line,
)
from engine.protocol.structured import (
    MAX_TOOL_CALLS,
    ToolCall,
    ToolChoice,
    ToolSpec,
    check_structure,
)

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
# Why an answer ended in error, for programs: the API picks its HTTP status by it and the
# chat panel its banner. The sentence in TokenEvent.error is for people and may be reworded
# at will; nothing branches on its words.
EventErrorCode = Literal[
    "context_length_exceeded",  # the prompt does not fit the context (prompt + answer): a client error
    "bad_request",  # the request cannot be served as asked (empty prompt, a grammar that does not compile, ...)
    "peer_lost",  # a pipeline stage failed or stopped answering: the fleet, not the request
    "closed",  # the engine was closed while the request waited or ran
    "engine",  # anything else: the engine failed on this request
]
EVENT_ERROR_CODES: tuple[str, ...] = get_args(EventErrorCode)
CLIENT_ERROR_CODES = ("context_length_exceeded", "bad_request")  # the request's fault (HTTP 400)
MAX_TEXT_CHARS = 1_000_000  # one chat message or prompt
MAX_MESSAGES = 1_000
MAX_STOP_STRINGS = 16
MAX_NEW_TOKENS = 1_000_000
MAX_STOP_CHARS = 256  # one stop string
MAX_ID_CHARS = 128  # request ids
MAX_TOKEN_ID = 2**31 - 1  # token ids fit an int32 tensor on the data plane
MAX_COUNT = 2**63 - 1  # counters fit a signed 64-bit int on the wire
MAX_ERROR_CHARS = 1_000  # an error reason is one line, not a traceback
SpeculativeMode = Literal["off", "draft", "lookup"]  # speculative decoding: none, a draft model, prompt lookup
SPECULATIVE_MODES: tuple[str, ...] = get_args(SpeculativeMode)
MAX_SPEC_K = 16  # drafted tokens per speculative step at most
MAX_TOP_LOGPROBS = 20  # alternatives per position with logprobs (OpenAI's limit)
MAX_TOKEN_CHARS = 256  # one token's text
_INF = float("inf")


def _is_request_id(v: str) -> bool:
    return _is_text(v, MAX_ID_CHARS, allow_empty=False)


def _token_ids_ok(ids: tuple[int, ...], most: int) -> bool:
    return len(ids) <= most and all(0 <= t <= MAX_TOKEN_ID for t in ids)


class ChatMessage(Message):
    KIND: ClassVar[str] = "chat_message"
    role: Role  # "system" | "user" | "assistant" | "tool" (a tool's result)
    content: str  # the text of the turn
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns: the calls the model made
    tool_call_id: str | None = None  # tool turns: which call this answers

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r:.40}")
        _require(len(self.content) <= MAX_TEXT_CHARS, "content is too long")
        _require(len(self.tool_calls) <= MAX_TOOL_CALLS, f"tool_calls must be at most {MAX_TOOL_CALLS} ToolCall values")
        _require(not self.tool_calls or self.role == "assistant", "only an assistant turn has tool calls")
        _require((self.tool_call_id is not None) == (self.role == "tool")
                 and (self.tool_call_id is None or _is_text(self.tool_call_id, 128, allow_empty=False)),
                 "a tool turn (and only a tool turn) names the tool_call_id it answers")


class SamplingParams(Message):
    KIND: ClassVar[str] = "sampling_params"
    max_tokens: int = 256  # new tokens at most
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 = no top-k cut
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages repeats (CTRL rule)
    seed: int | None = None  # fixes the sampling RNG of this request
    stop: tuple[str, ...] = ()  # generation ends before any of these strings
    ignore_eos: bool = False  # go on past end-of-sequence tokens until max_tokens or a stop string
    #                           (benchmarks and tests: an answer's length must not depend on the weights)
    logprobs: int | None = None  # None: none; n: each new token's logprob and the n likeliest alternatives

    def __post_init__(self) -> None:
        _require(1 <= self.max_tokens <= MAX_NEW_TOKENS, f"max_tokens must be an integer in 1..{MAX_NEW_TOKENS}")
        _require(_in_range(self.temperature, 0.0, 100.0), "temperature must be a number in 0..100")
        _require(_in_range(self.top_p, 0.0, 1.0) and self.top_p > 0.0, "top_p must be in (0, 1]")
        _require(0 <= self.top_k <= MAX_TOKEN_ID, "top_k must be a non-negative integer")
        _require(_in_range(self.repetition_penalty, 0.0, 100.0) and self.repetition_penalty > 0.0,
                 "repetition_penalty must be in (0, 100]")
        _require(self.seed is None or 0 <= self.seed <= MAX_COUNT, "seed must be a non-negative 63-bit integer")
        _require(len(self.stop) <= MAX_STOP_STRINGS
                 and all(_is_text(s, MAX_STOP_CHARS, allow_empty=False) for s in self.stop),
                 f"stop must be at most {MAX_STOP_STRINGS} non-empty strings "
                 f"of at most {MAX_STOP_CHARS} characters")
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                 f"logprobs must be nil or an integer in 0..{MAX_TOP_LOGPROBS}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            _set_float(self, name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculativeParams(Message):
    """Speculative decoding of one request (docs/speculative.md). The output
    distribution is the target's either way: greedy answers are identical."""

    KIND: ClassVar[str] = "speculative_params"
    mode: SpeculativeMode = "off"  # "off" | "draft" (the engine's draft model) | "lookup" (prompt n-grams)
    k: int | None = None  # drafted tokens per step (the start value when adaptive); None = engine default
    adaptive: bool = True  # adapt k to the running acceptance rate (1..max(k, engine maximum))

    def __post_init__(self) -> None:
        _require(self.mode in SPECULATIVE_MODES,
                 f"speculative mode must be one of {SPECULATIVE_MODES}, got {self.mode!r:.40}")
        _require(self.k is None or 1 <= self.k <= MAX_SPEC_K, f"speculative k must be an integer in 1..{MAX_SPEC_K}")


class GenerateRequest(Message):
    """One generation: either a chat (messages) or a raw prompt, never both."""

    KIND: ClassVar[str] = "generate_request"
    request_id: str  # unique per engine; chosen by the client
    messages: tuple[ChatMessage, ...] | None = None  # chat turns, templated by the engine
    prompt: str | None = None  # raw text, no template (the /v1/completions path)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    speculative: SpeculativeParams | None = None  # None = the engine's default (set at its start)
    tools: tuple[ToolSpec, ...] = ()  # functions the model may call (chat only; engine/runtime/tool_format.py)
    tool_choice: ToolChoice = "auto"  # "auto" | "none" | "required" (a call is forced by a grammar)
    forced_tool: str | None = None  # with "required": the one tool it must call
    json_schema: str | None = None  # the answer is a JSON document valid under this schema (JSON text)

    @property
    def constrained(self) -> bool:
        """The answer is held to a grammar (a JSON schema or a forced tool call)."""
        return self.json_schema is not None or (self.tool_choice == "required" and bool(self.tools))

    def __post_init__(self) -> None:
        _require(_is_request_id(self.request_id),
                 f"request_id must be a non-empty string of at most {MAX_ID_CHARS} characters")
        _require((self.messages is None) != (self.prompt is None),
                 "give exactly one of messages or prompt")
        if self.messages is not None:
            _require(0 < len(self.messages) <= MAX_MESSAGES, f"messages must hold 1..{MAX_MESSAGES} chat messages")
        if self.prompt is not None:
            _require(len(self.prompt) <= MAX_TEXT_CHARS, "prompt must be a string of reasonable length")
        check_structure(self.tools, self.tool_choice, self.forced_tool, self.json_schema)
        _require(not self.tools or self.messages is not None, "tools need a chat (messages), not a raw prompt")
        # A logprob is read from the logits row the token was picked from, and a grammar
        # masks each token's row before the pick; a speculative step accepts several
        # tokens from one verify pass and keeps no such rows (yet). So such a request
        # does not speculate: the engine's default becomes "off".
        for asked, what in ((self.sampling.logprobs is not None, "logprobs"),
                            (self.constrained, "a JSON schema or a required tool call")):
            if not asked:
                continue
            _require(self.speculative is None or self.speculative.mode == "off",
                     f"speculative decoding and {what} do not go together; ask for one of them")
            if self.speculative is None:
                force_setattr(self, "speculative", SpeculativeParams(mode="off"))


class Usage(Message):
    KIND: ClassVar[str] = "usage"
    prompt_tokens: int  # tokens the engine read (after templating)
    completion_tokens: int  # tokens it generated
    cached_tokens: int = 0  # of the prompt tokens, those whose KV came from an earlier request

    def __post_init__(self) -> None:
        _require(0 <= self.prompt_tokens <= MAX_COUNT, "bad prompt_tokens")
        _require(0 <= self.completion_tokens <= MAX_COUNT, "bad completion_tokens")
        _require(0 <= self.cached_tokens <= self.prompt_tokens, "cached_tokens must be an integer in 0..prompt_tokens")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(Message):
    KIND: ClassVar[str] = "timings"
    queued_s: float  # from submit to the start of prefill
    ttft_s: float  # from submit to the first token
    total_s: float  # from submit to the end
    decode_tok_s: float  # generated tokens per second after the first one (0 if < 2 tokens)

    def __post_init__(self) -> None:
        for name in ("queued_s", "ttft_s", "total_s", "decode_tok_s"):
            _require(_in_range(getattr(self, name), 0.0, _INF), f"{name} must be a non-negative number")
            _set_float(self, name)


class TokenLogprob(Message):
    """One generated token's log-probability under the model's next-token distribution
    (the raw logits' log-softmax: before temperature, top-k/top-p and penalties), and the
    likeliest tokens at that position, best first. Built per token: its rules are checked
    by validate() where it crosses the wire, not when it is built."""

    KIND: ClassVar[str] = "token_logprob"
    token_id: int
    text: str  # the token alone, decoded (a piece of a multi-byte character shows as U+FFFD)
    logprob: float  # natural log, <= 0
    top_ids: tuple[int, ...] = ()
    top_texts: tuple[str, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def validate(self) -> None:
        """Raise ProtocolError unless the rules hold (the codec calls this)."""
        _require(0 <= self.token_id <= MAX_TOKEN_ID, "bad token_id")
        _require(_is_text(self.text, MAX_TOKEN_CHARS), "bad token text")
        _require(_in_range(self.logprob, -_INF, 0.0), "logprob must be a number <= 0")
        n = len(self.top_ids)
        _require(n <= MAX_TOP_LOGPROBS and all(0 <= t <= MAX_TOKEN_ID for t in self.top_ids), "bad top_ids")
        _require(len(self.top_texts) == n and all(_is_text(t, MAX_TOKEN_CHARS) for t in self.top_texts),
                 "bad top_texts")
        _require(len(self.top_logprobs) == n and all(_in_range(v, -_INF, 0.0) for v in self.top_logprobs),
                 "bad top_logprobs")


class TokenEvent(Message):
    """A piece of a streamed answer. The last event of a request has
    finish_reason set, with usage and timings; earlier ones have neither.
    Built for every token: its rules are checked by validate() where it crosses
    the wire (the codec calls it), not when an engine builds it."""

    KIND: ClassVar[str] = "token_event"
    request_id: str  # which request this belongs to
    text: str = ""  # new text since the previous event (may be "" while a
    #                 multi-byte character or a possible stop string is pending)
    token_ids: tuple[int, ...] = ()  # new token ids since the previous event
    finish_reason: FinishReason | None = None  # None while streaming, then one of FINISH_REASONS
    usage: Usage | None = None  # on the final event
    timings: Timings | None = None  # on the final event
    error: str | None = None  # one-line reason when finish_reason == "error"
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids entry when the request asked for them
    error_code: EventErrorCode | None = None  # one of EVENT_ERROR_CODES with an error ("engine" when not given)

    def __post_init__(self) -> None:
        if self.error is not None and self.error_code is None:
            force_setattr(self, "error_code", "engine")

    def validate(self) -> None:
        """Raise ProtocolError unless the rules hold (the codec calls this)."""
        _require(_is_request_id(self.request_id), "bad request_id")
        _require(len(self.text) <= MAX_TEXT_CHARS, "text must be a string of reasonable length")
        _require(_token_ids_ok(self.token_ids, MAX_NEW_TOKENS), f"token_ids must be integers in 0..{MAX_TOKEN_ID}")
        _require(self.finish_reason is None or self.finish_reason in FINISH_REASONS,
                 f"finish_reason must be one of {FINISH_REASONS}")
        # An error reason and finish_reason "error" come together or not at all,
        # so a client never shows an error without a why, nor a why without one.
        _require(self.error is None or len(self.error) <= MAX_ERROR_CHARS,
                 f"error must be a string of at most {MAX_ERROR_CHARS} characters")
        _require((self.error is not None) == (self.finish_reason == "error"),
                 "error goes with finish_reason 'error', and only with it")
        _require(self.error_code is None if self.error is None else self.error_code in EVENT_ERROR_CODES,
                 f"error_code goes with an error, and is one of {EVENT_ERROR_CODES}")
        _require(self.finish_reason is not None or (self.usage is None and self.timings is None),
                 "usage and timings belong to the final event only")
        _require(not self.logprobs or [t.token_id for t in self.logprobs] == list(self.token_ids),
                 "logprobs must be empty or one TokenLogprob per token id, in order")
        for lp in self.logprobs:
            lp.validate()

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


class ErrorReply(Message):
    """A peer's answer to input it could not handle or work it will not take.
    Built from a ProtocolError with from_exception, or directly for non-wire failures."""

    KIND: ClassVar[str] = "error_reply"
    request_id: str | None  # the request refused, when it could be read; else None
    code: ErrorCode  # one of ERROR_CODES, for the other side to branch on
    message: str  # one-line human reason, safe to show; no internals
    refusal: Refusal | None = None  # code "refused" only (and always): why, with the bytes, for programs

    def __post_init__(self) -> None:
        _require(self.request_id is None or _is_request_id(self.request_id), "bad request_id")
        _require(self.code in ERROR_CODES, f"code must be one of {ERROR_CODES}")
        _require(len(self.message) <= MAX_ERROR_CHARS,
                 f"message must be a string of at most {MAX_ERROR_CHARS} characters")
        # A program reading "refused" always finds the reason; no other code carries one.
        _require((self.code == "refused") == (self.refusal is not None),
                 "a refusal goes with code 'refused', and only with it")

    @classmethod
    def from_exception(cls, exc: BaseException, request_id: str | None = None) -> ErrorReply:
        """A reply for exc: a ProtocolError keeps its code and reason; anything
        else becomes "internal" with no detail, because exception text from
        deep inside an engine may leak paths or data."""
        rid = request_id if isinstance(request_id, str) and _is_request_id(request_id) else None
        if isinstance(exc, ProtocolError):
            return cls(rid, exc.code, one_line(exc, MAX_ERROR_CHARS), exc.refusal)  # type: ignore[arg-type]
        return cls(rid, "internal", "internal error")
