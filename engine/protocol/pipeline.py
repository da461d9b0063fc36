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

Control messages (StageConfigure, StagePing, StageFree, StageShutdown) go
straight from the coordinator to each worker; the worker answers a ping with
a StagePong on the same socket. A worker that cannot handle an input answers
with the shared ErrorReply (request_id = the stream id when it could be read).

Importing this module registers the messages with the codec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from engine.protocol._checks import is_int, is_num, is_text, require, set_float
from engine.protocol.codec import register

MAX_STREAM_ID_CHARS = 128  # stream ids (chosen by the coordinator, never reused)
MAX_NAME_CHARS = 128  # stage names shown in messages, e.g. "stage 2"
MAX_ENDPOINT_CHARS = 255  # "tcp://host:port"
MAX_STAGES = 256  # stages of one ring
MAX_POSITION = 2**31 - 1  # token positions fit an int32
MAX_SEQ = 2**63 - 1  # step counters fit a signed 64-bit int
MAX_FREE = 4096  # stream ids in one StageFree
MAX_MS = 1e9  # a compute time in ms (11 days): anything above is garbage

# zmq endpoints we accept for the data plane: tcp (any host, port or *), ipc, inproc.
_ENDPOINT = re.compile(r"(tcp://[^\s/]+:(\d{1,5}|\*)|ipc://\S+|inproc://\S+)\Z")


def _stream_id(v: object) -> bool:
    return is_text(v, MAX_STREAM_ID_CHARS, allow_empty=False)


def is_endpoint(v: object) -> bool:
    return isinstance(v, str) and len(v) <= MAX_ENDPOINT_CHARS and _ENDPOINT.match(v) is not None


def _ms_tuple(v: object) -> bool:
    return isinstance(v, tuple) and len(v) <= MAX_STAGES and all(
        is_num(x) and 0.0 <= x <= MAX_MS for x in v)


@register
@dataclass(frozen=True)
class StageConfigure:
    """Coordinator -> worker: where to send outputs, and which stage it is.

    A worker started without --next serves nothing until it gets one; a new
    one (a re-planned ring) simply reconnects its output socket."""

    KIND: ClassVar[str] = "pipeline_configure"
    next_endpoint: str  # the next stage's bind address, or the coordinator's for the last stage
    stage_index: int  # position in the ring, 0-based
    stage_count: int  # stages in the ring
    name: str  # how messages name this stage, e.g. "stage 2"

    def __post_init__(self) -> None:
        require(is_endpoint(self.next_endpoint), "next_endpoint must be a zmq endpoint (tcp://host:port)")
        require(is_int(self.stage_count) and 1 <= self.stage_count <= MAX_STAGES,
                f"stage_count must be in 1..{MAX_STAGES}")
        require(is_int(self.stage_index) and 0 <= self.stage_index < self.stage_count,
                "stage_index must be in 0..stage_count-1")
        require(is_text(self.name, MAX_NAME_CHARS, allow_empty=False), "name must be a short non-empty string")


@register
@dataclass(frozen=True)
class StagePing:
    """Coordinator -> worker: health check; answered with a StagePong."""

    KIND: ClassVar[str] = "pipeline_ping"
    nonce: int  # echoed in the pong, to match answers with questions

    def __post_init__(self) -> None:
        require(is_int(self.nonce) and 0 <= self.nonce <= MAX_SEQ, "nonce must be a non-negative integer")


@register
@dataclass(frozen=True)
class StagePong:
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
        require(is_int(self.nonce) and 0 <= self.nonce <= MAX_SEQ, "bad nonce")
        require(is_text(self.name, MAX_NAME_CHARS), "bad name")
        for f in ("pid", "start", "end", "streams", "queue_depth", "steps", "errors"):
            require(is_int(getattr(self, f)) and 0 <= getattr(self, f) <= MAX_SEQ, f"bad {f}")
        require(self.start < self.end, "start must be below end")
        require(isinstance(self.configured, bool), "configured must be a bool")
        for f in ("compute_ms_last", "compute_ms_mean"):
            require(is_num(getattr(self, f)) and 0.0 <= getattr(self, f) <= MAX_MS, f"bad {f}")
            set_float(self, f)


@register
@dataclass(frozen=True)
class StageStep:
    """One chunk of one stream, travelling the ring (+ one tensor frame).

    Each stage runs it on the stream's own InferRequest (its KV state), with
    attention_mask = ones [1, past + n] and position_ids = past .. past+n-1,
    then forwards its hidden states with its compute time appended."""

    KIND: ClassVar[str] = "pipeline_step"
    stream_id: str  # the coordinator's id of the stream (not the request id)
    seq: int  # step number within the stream, 0-based; the result echoes it
    past: int  # tokens already in the stream's KV state on every stage
    reset: bool  # first step of the stream: open it with an empty KV state
    want_token: bool  # last stage answers with the next token (False: a non-final prefill chunk, ack only)
    want_logits: bool  # last stage also returns the last position's logits row (sampling)
    stage_ms: tuple[float, ...] = ()  # compute ms of each stage passed so far

    def __post_init__(self) -> None:
        require(_stream_id(self.stream_id), "stream_id must be a short non-empty string")
        require(is_int(self.seq) and 0 <= self.seq <= MAX_SEQ, "seq must be a non-negative integer")
        require(is_int(self.past) and 0 <= self.past <= MAX_POSITION, f"past must be in 0..{MAX_POSITION}")
        for f in ("reset", "want_token", "want_logits"):
            require(isinstance(getattr(self, f), bool), f"{f} must be a bool")
        require(not self.reset or self.past == 0, "a reset step starts at past 0")
        require(not self.want_logits or self.want_token, "want_logits needs want_token")
        require(_ms_tuple(self.stage_ms), "stage_ms must be at most 256 non-negative numbers")
        object.__setattr__(self, "stage_ms", tuple(float(x) for x in self.stage_ms))


@register
@dataclass(frozen=True)
class StageResult:
    """Last stage -> coordinator: a step is done (+ a logits frame when asked)."""

    KIND: ClassVar[str] = "pipeline_result"
    stream_id: str  # of the step
    seq: int  # of the step
    token: int | None  # greedy next token (argmax of the last position); None for an ack
    stage_ms: tuple[float, ...]  # compute ms of every stage, in ring order

    def __post_init__(self) -> None:
        require(_stream_id(self.stream_id), "bad stream_id")
        require(is_int(self.seq) and 0 <= self.seq <= MAX_SEQ, "bad seq")
        require(self.token is None or (is_int(self.token) and 0 <= self.token <= MAX_POSITION),
                "token must be a non-negative integer or nil")
        require(_ms_tuple(self.stage_ms), "bad stage_ms")
        object.__setattr__(self, "stage_ms", tuple(float(x) for x in self.stage_ms))


@register
@dataclass(frozen=True)
class StageFree:
    """Coordinator -> worker: drop these streams' state and queued steps
    (cancel, finish). Steps of a freed stream that arrive later are dropped."""

    KIND: ClassVar[str] = "pipeline_free"
    stream_ids: tuple[str, ...]  # streams to free

    def __post_init__(self) -> None:
        require(isinstance(self.stream_ids, tuple) and len(self.stream_ids) <= MAX_FREE
                and all(_stream_id(s) for s in self.stream_ids),
                f"stream_ids must be at most {MAX_FREE} stream ids")


@register
@dataclass(frozen=True)
class StageShutdown:
    """Coordinator -> worker: exit cleanly (the runner still kills stragglers)."""

    KIND: ClassVar[str] = "pipeline_shutdown"
    reason: str = ""  # for the worker's log

    def __post_init__(self) -> None:
        require(is_text(self.reason, MAX_NAME_CHARS), "reason must be a short string")
