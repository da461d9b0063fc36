"""The base class of every protocol message.

A message is a frozen msgspec Struct that refuses unknown fields, with a str
ClassVar KIND (its name on the wire). msgspec checks the field types when a
message is decoded (no bool for an int, no float for an int, no str for bytes,
no missing or unknown field); __post_init__ checks what types cannot say --
ranges, lengths, patterns, the rules between fields -- and runs both when a
message is built in code and when it is decoded. A class built for every token
of an answer may instead put those checks in validate(), which the codec runs
when the message is encoded or decoded (engine.protocol.codec), so building one
in process costs no more than a tuple.

Messages hold no reference cycles (scalars, tuples and other messages only), so
the garbage collector does not track them (gc=False).
"""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A protocol message (see the module docstring); subclasses add KIND and fields."""
