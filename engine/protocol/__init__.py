"""Flotilla's one wire vocabulary: typed messages, their codec, the version.

Light on purpose (numpy and msgspec only, nothing else from engine, no torch),
because the desktop app imports it.

    data = encode(GenerateRequest("r1", prompt="hi"))
    msg = decode(data)                      # ProtocolError on any bad input
    frames = encode_frames(msg, [hidden])   # header + raw tensor frames
    msg, tensors = decode_frames(frames)
"""

from engine.protocol.base import Message
from engine.protocol.codec import (
    MAX_MESSAGE_BYTES,
    decode,
    encode,
    register,
    registered,
)
from engine.protocol.errors import ERROR_CODES, REFUSAL_REASONS, ProtocolError, Refusal
from engine.protocol.frames import (
    DTYPES,
    MAX_TENSOR_BYTES,
    FramedHeader,
    TensorSpec,
    decode_frames,
    encode_frames,
)
from engine.protocol.messages import (
    EVENT_ERROR_CODES,
    FINISH_REASONS,
    ROLES,
    ChatMessage,
    ErrorReply,
    GenerateRequest,
    SamplingParams,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from engine.protocol.structured import TOOL_CHOICES, ToolCall, ToolSpec
from engine.protocol.version import PROTOCOL_VERSION

# Every message family registers itself with the codec on import; importing
# them here means any peer that imports engine.protocol can decode them all.
from engine.protocol import control as _control  # noqa: E402,F401  (fleet control plane)
from engine.protocol import pipeline as _pipeline  # noqa: E402,F401  (pipeline data plane)

__all__ = [
    "DTYPES",
    "ERROR_CODES",
    "EVENT_ERROR_CODES",
    "FINISH_REASONS",
    "MAX_MESSAGE_BYTES",
    "MAX_TENSOR_BYTES",
    "PROTOCOL_VERSION",
    "REFUSAL_REASONS",
    "ROLES",
    "ChatMessage",
    "ErrorReply",
    "FramedHeader",
    "GenerateRequest",
    "Message",
    "ProtocolError",
    "Refusal",
    "SamplingParams",
    "TensorSpec",
    "Timings",
    "TokenEvent",
    "TokenLogprob",
    "TOOL_CHOICES",
    "ToolCall",
    "ToolSpec",
    "Usage",
    "decode",
    "decode_frames",
    "encode",
    "encode_frames",
    "register",
    "registered",
]
