"""Messages of the pipeline data plane: coordinator <-> shard workers.

The ring (docs: DESIGN.md "Processes and wires"):

    coordinator --StageStep--> stage 0 --StageStep--> ... --> last stage
         ^                                                        |
         +--------------------- StageResult ----------------------+

Every message travels as tensor frames (engine.protocol.frames): frame 0 the
header, then raw tensor bytes. A StageStep carries one tensor: token ids
int64 [1, n] into stage 0, hidden states float32 [1, n, H] between stages. A
StageResult carries the next token id in its header and, only when the
request samples, the last position's logits row float32 [V] as a tensor.

Speculative decoding (engine/speculative, docs/speculative.md) uses three
more StageStep fields. Rejected draft tokens stay in every stage's KV state
and are hidden: `hide` names physical ranges that become invisible
(attention_mask 0) from this step on, `position` is the logical position of
the step's first token (= the visible tokens before it, checked by every
stage), and `compact` asks each stage to drop its hidden positions physically
before the step. With `want_all` the last stage answers for every position
of the step: StageResult.tokens holds the argmax of each, and the logits
tensor (when asked) is float32 [n, V].

Control messages (StageConfigure, StagePing, StageFree, StageShutdown) go
straight from the coordinator to each worker; the worker answers a ping with
a StagePong on the same socket. A worker that cannot handle an input answers
with the shared ErrorReply (request_id = the stream id when it could be read).

Importing this module registers the messages with the codec.
"""

from __future__ import annotations

import re
from typing import ClassVar

from engine.protocol._checks import float_tuple, in_range, is_text, require, set_float
from engine.protocol.base import Message
from engine.protocol.codec import register

MAX_STREAM_ID_CHARS = 128  # stream ids (chosen by the coordinator, never reused)
MAX_NAME_CHARS = 128  # stage names shown in messages, e.g. "stage 2"
MAX_ENDPOINT_CHARS = 255  # "tcp://host:port"
MAX_STAGES = 256  # stages of one ring
MAX_POSITION = 2**31 - 1  # token positions fit an int32
MAX_SEQ = 2**63 - 1  # step counters fit a signed 64-bit int
MAX_FREE = 4096  # stream ids in one StageFree
MAX_MS = 1e9  # a compute time in ms (11 days): anything above is garbage
MAX_HIDE_RANGES = 256  # [start, end) ranges one StageStep may hide
MAX_STEP_TOKENS = 8192  # tokens of one step (= a worker's largest chunk)

# zmq endpoints we accept for the data plane: tcp (any host, port or *), ipc, inproc.
_ENDPOINT = re.compile(r"(tcp://[^\s/]+:(\d{1,5}|\*)|ipc://\S+|inproc://\S+)\Z")
_Z85 = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")  # a CurveZMQ key in Z85 text


def _stream_id(v: str) -> bool:
    return is_text(v, MAX_STREAM_ID_CHARS, allow_empty=False)


def _is_z85(v: object) -> bool:
    return isinstance(v, str) and _Z85.match(v) is not None


def is_endpoint(v: object) -> bool:
    return isinstance(v, str) and len(v) <= MAX_ENDPOINT_CHARS and _ENDPOINT.match(v) is not None


def _ms_tuple(v: tuple[float, ...]) -> bool:
    return len(v) <= MAX_STAGES and all(in_range(x, 0.0, MAX_MS) for x in v)


@register
class StageConfigure(Message):
    """Coordinator -> worker: where to send outputs, and which stage it is.

    A worker started without --next serves nothing until it gets one; a new
    one (a re-planned ring) simply reconnects its output socket."""

    KIND: ClassVar[str] = "pipeline_configure"
    next_endpoint: str  # the next stage's bind address, or the coordinator's for the last stage
    stage_index: int  # position in the ring, 0-based
    stage_count: int  # stages in the ring
    name: str  # how messages name this stage, e.g. "stage 2"
    # CURVE public key (Z85) of the socket at next_endpoint; "" = that hop is plaintext
    # (only the local loopback runner, when asked). A CURVE worker refuses "".
    next_key: str = ""

    def __post_init__(self) -> None:
        require(is_endpoint(self.next_endpoint), "next_endpoint must be a zmq endpoint (tcp://host:port)")
        require(self.next_key == "" or _is_z85(self.next_key), "next_key must be a Z85 public key or empty")
        require(1 <= self.stage_count <= MAX_STAGES, f"stage_count must be in 1..{MAX_STAGES}")
        require(0 <= self.stage_index < self.stage_count,
                "stage_index must be in 0..stage_count-1")
        require(is_text(self.name, MAX_NAME_CHARS, allow_empty=False), "name must be a short non-empty string")


@register
class StagePing(Message):
    """Coordinator -> worker: health check; answered with a StagePong."""

    KIND: ClassVar[str] = "pipeline_ping"
    nonce: int  # echoed in the pong, to match answers with questions

    def __post_init__(self) -> None:
        require(0 <= self.nonce <= MAX_SEQ, "nonce must be a non-negative integer")


@register
class StagePong(Message):
    """Worker -> coordinator: alive, and how busy."""

    KIND: ClassVar[str] = "pipeline_pong"
    nonce: int  # of the ping answered
    name: str  # stage name ("" until configured)
    pid: int  # worker process id (for messages and for the runner)
    start: int  # first layer of its shard (inclusive)
    end: int  # last layer of its shard (exclusive)
    configured: bool  # has a next endpoint: ready to serve steps
    streams: int  # streams holding KV state here
    queue_depth: int  # steps received but not computed yet
    steps: int  # steps computed since start
    compute_ms_last: float  # compute time of the last step
    compute_ms_mean: float  # mean compute time per step since start
    errors: int  # inputs answered with an ErrorReply since start

    def __post_init__(self) -> None:
        require(0 <= self.nonce <= MAX_SEQ, "bad nonce")
        require(is_text(self.name, MAX_NAME_CHARS), "bad name")
        for f in ("pid", "start", "end", "streams", "queue_depth", "steps", "errors"):
            require(0 <= getattr(self, f) <= MAX_SEQ, f"bad {f}")
        require(self.start < self.end, "start must be below end")
        for f in ("compute_ms_last", "compute_ms_mean"):
            require(in_range(getattr(self, f), 0.0, MAX_MS), f"bad {f}")
            set_float(self, f)


@register
class StageStep(Message):
    """One chunk of one stream, travelling the ring (+ one tensor frame).

    Each stage runs it on the stream's own InferRequest (its KV state). It
    first hides the `hide` ranges, then (with `compact`) drops every hidden
    position from the state; then it runs the n tokens with attention_mask =
    [1, past + n] (0 at hidden positions) and position_ids = position ..
    position+n-1, and forwards its hidden states with its compute time
    appended. Without speculation hide is empty and position is None (= past):
    the mask is all ones, exactly as before."""

    KIND: ClassVar[str] = "pipeline_step"
    stream_id: str  # the coordinator's id of the stream (not the request id)
    seq: int  # step number within the stream, 0-based; the result echoes it
    past: int  # tokens physically in the stream's KV state on every stage (visible or hidden)
    reset: bool  # first step of the stream: open it with an empty KV state
    want_token: bool  # last stage answers with the next token (False: a non-final prefill chunk, ack only)
    want_logits: bool  # last stage also returns logits rows (sampling): the last one, or all with want_all
    stage_ms: tuple[float, ...] = ()  # compute ms of each stage passed so far
    position: int | None = None  # logical position of the first token (visible tokens before it); None = past
    hide: tuple[int, ...] = ()  # physical [start, end) ranges to hide before this step, flattened, ascending
    compact: bool = False  # drop every hidden position from the KV state before this step
    want_all: bool = False  # last stage answers for every position (tokens [n], logits [n, V])

    def __post_init__(self) -> None:
        require(_stream_id(self.stream_id), "stream_id must be a short non-empty string")
        require(0 <= self.seq <= MAX_SEQ, "seq must be a non-negative integer")
        require(0 <= self.past <= MAX_POSITION, f"past must be in 0..{MAX_POSITION}")
        require(not self.reset or self.past == 0, "a reset step starts at past 0")
        require(not self.want_logits or self.want_token, "want_logits needs want_token")
        require(not self.want_all or self.want_token, "want_all needs want_token")
        require(_ms_tuple(self.stage_ms), "stage_ms must be at most 256 non-negative numbers")
        float_tuple(self, "stage_ms")
        require(self.position is None or 0 <= self.position <= self.past, "position must be nil or in 0..past")
        require(_ranges(self.hide, self.past),
                f"hide must be at most {MAX_HIDE_RANGES} ascending, disjoint [start, end) pairs within 0..past")
        hidden = sum(self.hide[i + 1] - self.hide[i] for i in range(0, len(self.hide), 2))
        require(self.position is None or self.position <= self.past - hidden,
                "position cannot exceed the tokens left visible")
        require(not self.reset or (not self.hide and not self.compact and self.position in (None, 0)),
                "a reset step has nothing to hide or compact")

    @property
    def logical(self) -> int:
        """Logical position of the first token (past when nothing was ever hidden)."""
        return self.past if self.position is None else self.position


def _ranges(v: tuple[int, ...], past: int) -> bool:
    """Flattened ascending disjoint [start, end) pairs with 0 <= start < end <= past."""
    if not (len(v) % 2 == 0 and len(v) <= 2 * MAX_HIDE_RANGES):
        return False
    prev = 0
    for i in range(0, len(v), 2):
        a, b = v[i], v[i + 1]
        if not (prev <= a < b <= past):
            return False
        prev = b
    return True


@register
class StageResult(Message):
    """Last stage -> coordinator: a step is done (+ a logits frame when asked)."""

    KIND: ClassVar[str] = "pipeline_result"
    stream_id: str  # of the step
    seq: int  # of the step
    token: int | None  # greedy next token (argmax of the last position); None for an ack
    stage_ms: tuple[float, ...]  # compute ms of every stage, in ring order
    tokens: tuple[int, ...] = ()  # with want_all: the argmax of every position of the step, in order

    def __post_init__(self) -> None:
        require(_stream_id(self.stream_id), "bad stream_id")
        require(0 <= self.seq <= MAX_SEQ, "bad seq")
        require(self.token is None or 0 <= self.token <= MAX_POSITION, "token must be a non-negative integer or nil")
        require(len(self.tokens) <= MAX_STEP_TOKENS and all(0 <= t <= MAX_POSITION for t in self.tokens),
                f"tokens must be at most {MAX_STEP_TOKENS} non-negative integers")
        require(not self.tokens or self.token == self.tokens[-1], "token must be the last of tokens")
        require(_ms_tuple(self.stage_ms), "bad stage_ms")
        float_tuple(self, "stage_ms")


@register
class StageFree(Message):
    """Coordinator -> worker: drop these streams' state and queued steps
    (cancel, finish). Steps of a freed stream that arrive later are dropped."""

    KIND: ClassVar[str] = "pipeline_free"
    stream_ids: tuple[str, ...]  # streams to free

    def __post_init__(self) -> None:
        require(len(self.stream_ids) <= MAX_FREE and all(_stream_id(s) for s in self.stream_ids),
                f"stream_ids must be at most {MAX_FREE} stream ids")


@register
class StageShutdown(Message):
    """Coordinator -> worker: exit cleanly (the runner still kills stragglers)."""

    KIND: ClassVar[str] = "pipeline_shutdown"
    reason: str = ""  # for the worker's log

    def __post_init__(self) -> None:
        require(is_text(self.reason, MAX_NAME_CHARS), "reason must be a short string")
