"""Messages of the fleet control plane: controller <-> agent.

Three sockets carry them (docs/fleet.md has the picture):
  info    (plaintext)   InfoRequest -> InfoReply: what mDNS TXT says, for
                        networks where multicast is blocked. Nothing secret.
  pairing (CURVE, any key)   PairRequest -> PairReply, and nothing else.
  control (CURVE, allow-listed keys)   Status, Prepare/Chunk, Load, Unload, Stop;
                        the agent may also push AgentEvent (yield, worker exit).

Every request carries a request_id chosen by the controller; the reply echoes
it, so one DEALER can have several requests in flight. The agent also refuses a
request_id it has just seen from the same key (an application-level replay
guard on top of CURVE's per-connection nonces).

Importing this module registers the messages with the codec.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar, Literal, get_args

import msgspec

from engine.protocol._checks import in_range, is_text, require, set_float
from engine.protocol.base import Message
from engine.protocol.codec import register, wire_error

MAX_ID_CHARS = 128  # request ids, shard ids
MAX_NAME_CHARS = 255  # host names, device names, controller names
MAX_DETAIL_CHARS = 1_000  # one-line human reasons
MAX_DEVICES = 32
MAX_SHARDS = 1_024  # shards one agent reports
MAX_CHUNK_BYTES = 8 * 1024 * 1024  # one shard chunk; well under the codec's 16 MiB
MAX_SHARD_BYTES = 2**42  # 4 TiB: no shard is bigger, and the sum fits an int64
MAX_COUNT = 2**63 - 1
MAX_PORT = 65_535
MAX_RING_KEYS = 256  # agents of one ring (= MAX_STAGES of the data plane)
_INF = float("inf")

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_NODE_ID = re.compile(r"[0-9a-f]{32}\Z")
_Z85 = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")
_CODE = re.compile(r"[0-9]{6}\Z")
_FINGERPRINT = re.compile(r"[0-9a-f]{16}\Z")
_DEVICE = re.compile(r"[A-Z][A-Z0-9_.:,]{0,63}\Z")

ShardState = Literal["cached", "partial", "starting", "running", "exited"]
PairState = Literal["pending", "accepted", "rejected"]
EventKind = Literal["yield", "worker_exit", "yielding"]  # yielding: the user is back, unload now (grace)


def _rid(v: str) -> bool:
    return is_text(v, MAX_ID_CHARS, allow_empty=False)


def is_sha256(v: object) -> bool:
    """64 lower-case hex digits."""
    return isinstance(v, str) and _HEX64.match(v) is not None


def is_node_id(v: object) -> bool:
    """32 lower-case hex digits (a uuid4 without dashes)."""
    return isinstance(v, str) and _NODE_ID.match(v) is not None


def is_z85_key(v: object) -> bool:
    """A CurveZMQ public key in Z85 text: 40 characters of the Z85 alphabet."""
    return isinstance(v, str) and _Z85.match(v) is not None


def _port(v: int, allow_zero: bool = False) -> bool:
    return (0 if allow_zero else 1) <= v <= MAX_PORT


def _size(v: int) -> bool:
    return 0 <= v <= MAX_SHARD_BYTES


def _opt_time(v: float | None) -> bool:
    return v is None or in_range(v, 0.0, 1e11)


# ---------------------------------------------------------------- shared parts


@register
class DeviceInfo(Message):
    KIND: ClassVar[str] = "device_info"
    name: str  # OpenVINO device name: "CPU", "GPU.0", "NPU"
    full_name: str  # FULL_DEVICE_NAME, e.g. "Intel(R) Arc(TM) Graphics"; may be ""

    def __post_init__(self) -> None:
        require(is_text(self.name, 64, allow_empty=False), "device name must be 1..64 characters")
        require(is_text(self.full_name, MAX_NAME_CHARS), "device full_name is too long")


@register
class AgentInfo(Message):
    """What an agent announces: mDNS TXT, InfoReply and StatusReply all carry it."""

    KIND: ClassVar[str] = "agent_info"
    node_id: str  # stable per install (32 hex); regenerated if the install was cloned
    hostname: str  # for people; never used to address the node
    os: str  # e.g. "Linux 6.8", "Windows 11"
    version: str  # flotilla version of the agent
    protocol: int  # PROTOCOL_VERSION of the agent
    devices: tuple[DeviceInfo, ...]  # OpenVINO devices the agent has (not only shared ones)
    ram_total: int  # bytes
    ram_available: int  # bytes shards may use now: min(free RAM, sharing cap - running workers), thresholded
    idle: bool  # the local user has been away long enough for the sharing policy
    idle_since: float | None  # unix time the user was last active, None if unknown
    on_ac: bool | None  # mains power; None if unknown
    control_port: int  # CURVE, paired controllers only
    pair_port: int  # CURVE, any key, PairRequest only
    info_port: int  # plaintext, InfoRequest only
    public_key: str  # the agent's CurveZMQ public key, Z85 (the server key controllers use)
    fingerprint: str  # first 16 hex of sha256(public key); what people compare at a glance

    def __post_init__(self) -> None:
        require(is_node_id(self.node_id), "node_id must be 32 lower-case hex digits")
        for name in ("hostname", "os", "version"):
            require(is_text(getattr(self, name), MAX_NAME_CHARS), f"{name} is too long")
        require(0 <= self.protocol <= 65_535, "bad protocol")
        require(len(self.devices) <= MAX_DEVICES, "bad devices")
        require(_size(self.ram_total) and _size(self.ram_available), "bad RAM figures")
        require(_opt_time(self.idle_since), "bad idle_since")
        for name in ("control_port", "pair_port", "info_port"):
            require(_port(getattr(self, name)), f"{name} must be 1..{MAX_PORT}")
        require(is_z85_key(self.public_key), "public_key must be a 40-character Z85 key")
        require(_FINGERPRINT.match(self.fingerprint) is not None, "fingerprint must be 16 hex digits")
        if self.idle_since is not None:
            set_float(self, "idle_since")


@register
class AgentUp(Message):
    """An agent's first word to the process that started it (the tray, the app): it serves,
    on these ports. Written once as one JSON line on the agent's stdout (`flotilla agent
    --announce`), the way a shard worker says it is bound, so the starter reads fields and
    never parses a log line."""

    KIND: ClassVar[str] = "agent_up"
    node_id: str
    control_port: int
    pair_port: int
    info_port: int

    def __post_init__(self) -> None:
        require(is_node_id(self.node_id), "node_id must be 32 lower-case hex digits")
        for name in ("control_port", "pair_port", "info_port"):
            require(_port(getattr(self, name)), f"{name} must be 1..{MAX_PORT}")

    def line(self) -> str:
        """The JSON line the agent writes (one line, no newline)."""
        return json.dumps({"event": self.KIND, "node_id": self.node_id, "control_port": self.control_port,
                           "pair_port": self.pair_port, "info_port": self.info_port})

    @classmethod
    def from_line(cls, line: str | bytes) -> "AgentUp | None":
        """The message in one stdout line; None for any other line (a native library's print).
        A line that claims to be one but is malformed raises ProtocolError."""
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("event") != cls.KIND:
            return None
        fields = {k: v for k, v in obj.items() if k != "event"}
        try:
            return msgspec.convert(fields, cls)  # types, fields and rules checked as on the wire
        except msgspec.ValidationError as e:
            raise wire_error(cls.KIND, e) from None


@register
class ShardInfo(Message):
    KIND: ClassVar[str] = "shard_info"
    shard_id: str  # the controller's name for it, e.g. "llama-3.1-8b/L0-16"
    sha256: str  # content hash; the agent stores shards by it
    size: int  # bytes of the whole shard
    have_bytes: int  # bytes received so far (= size once cached)
    state: ShardState  # cached < partial < starting < running < exited
    pid: int | None  # worker process id while starting/running
    exit_code: int | None  # once exited; negative = killed by that signal
    device: str | None  # device the worker was started on

    def __post_init__(self) -> None:
        require(_rid(self.shard_id), "bad shard_id")
        require(is_sha256(self.sha256), "sha256 must be 64 lower-case hex digits")
        require(_size(self.size) and _size(self.have_bytes) and self.have_bytes <= self.size,
                "bad size/have_bytes")
        require(self.pid is None or 0 < self.pid < 2**31, "bad pid")
        require(self.exit_code is None or -255 <= self.exit_code <= 255, "bad exit_code")
        require(self.device is None or is_text(self.device, 64, allow_empty=False), "bad device")
        require(self.state in get_args(ShardState), f"state must be one of {get_args(ShardState)}")


# ---------------------------------------------------------------- info port


@register
class InfoRequest(Message):
    KIND: ClassVar[str] = "info_request"
    request_id: str  # echoed in the reply

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")


@register
class InfoReply(Message):
    KIND: ClassVar[str] = "info_reply"
    request_id: str  # of the InfoRequest
    info: AgentInfo  # the same facts as the mDNS TXT record

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")


# ---------------------------------------------------------------- pairing port


@register
class PairRequest(Message):
    """Ask to be paired, or (sent again) whether the owner has accepted yet.
    The controller's key is NOT in the body: the agent takes it from the CURVE
    handshake, so nobody can ask to pair a key they do not hold."""

    KIND: ClassVar[str] = "pair_request"
    request_id: str  # echoed in the reply
    controller_name: str  # shown to the owner next to the code, e.g. "alice-laptop"

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_text(self.controller_name, MAX_NAME_CHARS, allow_empty=False),
                f"controller_name must be 1..{MAX_NAME_CHARS} characters")


@register
class PairReply(Message):
    KIND: ClassVar[str] = "pair_reply"
    request_id: str  # of the PairRequest
    state: PairState  # pending until the owner accepts the code on the agent
    code: str  # 6 digits from both public keys, as the agent computes it
    agent_name: str  # the agent's host name, for the controller's screen

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(_CODE.match(self.code) is not None, "code must be 6 digits")
        require(self.state in get_args(PairState), f"state must be one of {get_args(PairState)}")
        require(is_text(self.agent_name, MAX_NAME_CHARS), "agent_name is too long")


# ---------------------------------------------------------------- control port


@register
class StatusRequest(Message):
    KIND: ClassVar[str] = "status_request"
    request_id: str  # echoed in the reply

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")


@register
class StatusReply(Message):
    KIND: ClassVar[str] = "status_reply"
    request_id: str  # of the StatusRequest
    info: AgentInfo  # current figures (not the thresholded announcement)
    sharing: bool  # the policy allows new work right now
    reason: str  # why not, when sharing is False ("user active", "on battery"); else ""
    shards: tuple[ShardInfo, ...]  # every shard the agent holds, partial or running

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_text(self.reason, MAX_DETAIL_CHARS), "reason is too long")
        require(len(self.shards) <= MAX_SHARDS, "bad shards")


@register
class PrepareRequest(Message):
    """Announce a shard. The reply says whether it is already cached, else how
    many bytes of it the agent has (resume from there with ChunkRequests)."""

    KIND: ClassVar[str] = "prepare_request"
    request_id: str  # echoed in the reply
    shard_id: str  # the controller's name for the shard
    sha256: str  # of the whole shard file
    size: int  # bytes of the whole shard file

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(_rid(self.shard_id), "bad shard_id")
        require(is_sha256(self.sha256), "sha256 must be 64 lower-case hex digits")
        require(_size(self.size), f"size must be 0..{MAX_SHARD_BYTES}")


@register
class PrepareReply(Message):
    KIND: ClassVar[str] = "prepare_reply"
    request_id: str  # of the PrepareRequest
    sha256: str  # the shard
    cached: bool  # complete and verified; no chunks needed
    have_bytes: int  # send chunks from this offset on

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_sha256(self.sha256), "bad sha256")
        require(_size(self.have_bytes), "bad have_bytes")


@register
class ChunkRequest(Message):
    """A piece of a prepared shard. Chunks arrive in order: offset must equal
    the agent's have_bytes, so a resend after a lost reply is refused rather
    than written twice (the controller re-Prepares to learn where to go on)."""

    KIND: ClassVar[str] = "chunk_request"
    request_id: str  # echoed in the reply
    sha256: str  # the shard this belongs to (announced by PrepareRequest)
    offset: int  # byte offset in the shard
    data: bytes  # 1..MAX_CHUNK_BYTES bytes
    chunk_sha256: str  # of data: catches a corrupted chunk before it lands on disk

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_sha256(self.sha256) and is_sha256(self.chunk_sha256), "bad sha256")
        require(_size(self.offset), "bad offset")
        require(0 < len(self.data) <= MAX_CHUNK_BYTES, f"data must be 1..{MAX_CHUNK_BYTES} bytes")


@register
class ChunkReply(Message):
    KIND: ClassVar[str] = "chunk_reply"
    request_id: str  # of the ChunkRequest
    sha256: str  # the shard
    have_bytes: int  # bytes the agent now holds
    complete: bool  # the last chunk arrived and the whole-shard hash matched

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_sha256(self.sha256), "bad sha256")
        require(_size(self.have_bytes), "bad have_bytes")


@register
class LoadRequest(Message):
    """Start a shard worker on a cached shard."""

    KIND: ClassVar[str] = "load_request"
    request_id: str  # echoed in the reply
    sha256: str  # a cached shard
    device: str  # OpenVINO device for the worker: "CPU", "GPU.0", "NPU", "AUTO"
    data_port: int  # TCP port the worker binds for the data plane; 0 = the worker picks
    exact: bool = False  # f32 inference + f32 KV cache (bit-comparable with torch; slower)
    # CURVE public keys (Z85) of the other agents of the ring: they may connect to this
    # worker's data port (the previous stage sends to it). Paired controllers always may.
    ring_keys: tuple[str, ...] = ()
    # What the plan reserved KV for, so the agent's start check sizes the worker as planned.
    context_length: int = 0  # tokens per stream; 0 = engine.models.profile.DEFAULT_CONTEXT
    streams: int = 1  # concurrent streams, each with its own KV
    # The worker's KV cache precision; "" = the device's default (u8 on CPU). "f16": the exact
    # prompt cache (engine/pipeline/prompt_cache.py), whose KV read-back must be lossless.
    kv_precision: Literal["", "u8", "f16", "bf16", "f32"] = ""

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_sha256(self.sha256), "bad sha256")
        require(0 <= self.context_length <= 1 << 24, "bad context_length")
        require(1 <= self.streams <= 1024, "streams must be 1..1024")
        require(_DEVICE.match(self.device) is not None, "device must look like CPU, GPU.0, NPU or AUTO")
        require(_port(self.data_port, allow_zero=True), f"data_port must be 0..{MAX_PORT}")
        require(len(self.ring_keys) <= MAX_RING_KEYS and all(is_z85_key(k) for k in self.ring_keys),
                f"ring_keys must be at most {MAX_RING_KEYS} Z85 public keys")


@register
class LoadReply(Message):
    KIND: ClassVar[str] = "load_reply"
    request_id: str  # of the LoadRequest
    shard: ShardInfo  # state "starting" or "running", with the worker's pid
    data_port: int = 0  # the TCP port the worker's data socket bound; 0 = unknown (it did not say)

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(_port(self.data_port, allow_zero=True), f"data_port must be 0..{MAX_PORT}")


@register
class UnloadRequest(Message):
    KIND: ClassVar[str] = "unload_request"
    request_id: str  # echoed in the reply
    sha256: str  # the shard whose worker to stop (the cached file stays)

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(is_sha256(self.sha256), "bad sha256")


@register
class UnloadReply(Message):
    KIND: ClassVar[str] = "unload_reply"
    request_id: str  # of the UnloadRequest
    shard: ShardInfo  # state "exited" with the worker's exit code

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")


@register
class StopRequest(Message):
    KIND: ClassVar[str] = "stop_request"
    request_id: str  # echoed in the reply
    shutdown: bool  # also end the agent process (after replying); else only its workers

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")


@register
class StopReply(Message):
    KIND: ClassVar[str] = "stop_reply"
    request_id: str  # of the StopRequest
    stopped: int  # workers stopped

    def __post_init__(self) -> None:
        require(_rid(self.request_id), "bad request_id")
        require(0 <= self.stopped <= MAX_COUNT, "bad stopped")


@register
class AgentEvent(Message):
    """Pushed by the agent, unasked, to every controller it has heard from:
    it yielded the PC to its user, or a worker exited on its own."""

    KIND: ClassVar[str] = "agent_event"
    node_id: str  # the agent
    event: EventKind  # what happened
    detail: str  # one line for people ("user returned", "exit code 1")
    shards: tuple[str, ...]  # sha256 of the shards concerned
    time: float  # unix time on the agent

    def __post_init__(self) -> None:
        require(is_node_id(self.node_id), "bad node_id")
        require(self.event in get_args(EventKind), f"event must be one of {get_args(EventKind)}")
        require(is_text(self.detail, MAX_DETAIL_CHARS), "detail is too long")
        require(len(self.shards) <= MAX_SHARDS and all(is_sha256(s) for s in self.shards), "bad shards")
        require(in_range(self.time, 0.0, _INF), "bad time")
        set_float(self, "time")


CONTROL_REQUESTS = (StatusRequest, PrepareRequest, ChunkRequest, LoadRequest, UnloadRequest,
                    StopRequest)
