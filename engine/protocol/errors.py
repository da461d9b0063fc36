"""The one error raised for bad wire input."""

from __future__ import annotations

# Codes a peer may put in an ErrorReply. A fixed, small set so the other side
# can branch on it; the human-readable detail goes in the message.
ERROR_CODES = (
    "malformed",  # not valid msgpack, wrong shape, wrong types, failed validation
    "unknown_kind",  # a message kind this peer does not know
    "version",  # another protocol major version
    "too_large",  # over a size limit (message bytes, tensor bytes)
    "not_paired",  # control request from a controller that is not paired
    "internal",  # the peer failed; details stay in its own log
    "not_found",  # the request, shard or model named does not exist here
    "overloaded",  # the peer is busy; try again later or elsewhere
)

MAX_REASON_CHARS = 300  # a reason is a log line, not a dump


def one_line(text: object, limit: int = MAX_REASON_CHARS) -> str:
    """Collapse whitespace runs with line breaks and cap the length, so a reason
    built from hostile input stays one short, safe line."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class ProtocolError(ValueError):
    """Input that is malformed, unknown, oversized or of the wrong version.

    str(e) is a one-line reason that is safe to send back to a peer; e.code is
    one of ERROR_CODES, ready for an ErrorReply.
    """

    def __init__(self, reason: object = "malformed input", code: str = "malformed") -> None:
        if code not in ERROR_CODES:  # a bug in the caller, but never hide the reason
            code = "malformed"
        self.code = code
        super().__init__(one_line(reason))
