"""The one error raised for bad wire input, and the codes a peer answers with."""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

from engine.protocol.base import Message

# Codes a peer may put in an ErrorReply. A fixed, small set so the other side
# can branch on it; the human-readable detail goes in the message.
ErrorCode = Literal[
    "malformed",  # not valid msgpack, wrong shape, wrong types, failed validation
    "unknown_kind",  # a message kind this peer does not know
    "version",  # another protocol major version
    "too_large",  # over a size limit (message bytes, tensor bytes)
    "not_paired",  # control request from a controller that is not paired
    "internal",  # the peer failed; details stay in its own log
    "not_found",  # the request, shard or model named does not exist here
    "overloaded",  # the peer is busy with other work; try again later or elsewhere
    "refused",  # the peer will not take this work as asked; the reply's Refusal says why, for programs
]
ERROR_CODES: tuple[str, ...] = get_args(ErrorCode)

# Why a peer refused ("refused" errors). Each byte reason carries need_bytes and
# limit_bytes; the others carry 0 for both.
RefusalReason = Literal[
    "not_sharing",  # its owner's sharing policy says no right now (switched off, user active, on battery)
    "device",  # the device asked for is not one its owner shares
    "policy_cap",  # over the owner's RAM cap for fleet work: need = the worker's bytes, limit = what the cap leaves
    "ram",  # over free RAM: need = the worker's bytes, limit = free RAM less the OS reserve
    "cpu_busy",  # the PC is busier than its owner lets new work start at
    "disk",  # not enough free disk for a shard: need = bytes to receive + margin kept free + transfers
    #          in flight, limit = free disk
]
REFUSAL_REASONS: tuple[str, ...] = get_args(RefusalReason)
BYTE_REASONS = ("policy_cap", "ram", "disk")  # the reasons that carry need_bytes / limit_bytes
MAX_BYTES = 2**63 - 1  # byte counts fit a signed 64-bit int on the wire

MAX_REASON_CHARS = 300  # a reason is a log line, not a dump


def one_line(text: object, limit: int = MAX_REASON_CHARS) -> str:
    """Collapse whitespace runs with line breaks and cap the length, so a reason
    built from hostile input stays one short, safe line."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class ProtocolError(ValueError):
    """Input that is malformed, unknown, oversized or of the wrong version, or
    work this peer refuses.

    str(e) is a one-line reason that is safe to send back to a peer; e.code is
    one of ERROR_CODES, ready for an ErrorReply; e.refusal is the Refusal of a
    "refused" error (giving one makes the code "refused"), else None.
    """

    def __init__(self, reason: object = "malformed input", code: str = "malformed",
                 refusal: Refusal | None = None) -> None:
        if refusal is not None:
            if not isinstance(refusal, Refusal):
                raise TypeError(f"refusal must be a Refusal, not {type(refusal).__name__}")
            code = "refused"
        elif code == "refused":  # programs branch on the Refusal: it must be there
            raise TypeError("a 'refused' ProtocolError needs its Refusal")
        elif code not in ERROR_CODES:  # a bug in the caller, but never hide the reason
            code = "malformed"
        self.code = code
        self.refusal = refusal
        super().__init__(one_line(reason))


class Refusal(Message):
    """Why a peer refused work, for programs (the message says it for people)."""

    KIND: ClassVar[str] = "refusal"
    reason: RefusalReason
    need_bytes: int = 0  # byte reasons: what the work needs; else 0
    limit_bytes: int = 0  # byte reasons: what the peer has for it; else 0

    def __post_init__(self) -> None:
        if self.reason not in REFUSAL_REASONS:
            raise ProtocolError(f"refusal reason must be one of {REFUSAL_REASONS}, got {self.reason!r:.40}")
        if not (0 <= self.need_bytes <= MAX_BYTES and 0 <= self.limit_bytes <= MAX_BYTES):
            raise ProtocolError("refusal need_bytes and limit_bytes must be integers in 0..2**63-1")
        if self.reason not in BYTE_REASONS and (self.need_bytes or self.limit_bytes):
            raise ProtocolError(f"a {self.reason} refusal carries no byte counts")

    @property
    def shortfall_bytes(self) -> int:
        """Bytes missing (0 for reasons without byte counts)."""
        return max(0, self.need_bytes - self.limit_bytes)
