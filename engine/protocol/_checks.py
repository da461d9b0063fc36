"""Small validation helpers shared by the message modules."""

from __future__ import annotations

import math

from engine.protocol.errors import ProtocolError


def require(cond: bool, why: str) -> None:
    """Raise ProtocolError(why) unless cond holds."""
    if not cond:
        raise ProtocolError(why)


def is_int(v: object) -> bool:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    """A finite int or float, not a bool; NaN and infinities fail."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_text(v: object, max_chars: int, *, allow_empty: bool = True) -> bool:
    """A str within a length bound."""
    return isinstance(v, str) and (allow_empty or len(v) > 0) and len(v) <= max_chars


def set_float(obj: object, name: str) -> None:
    """Store an int given for a float field as a float, so a message built in
    code equals (and has the same types as) its decoded copy."""
    v = getattr(obj, name)
    if is_int(v):
        object.__setattr__(obj, name, float(v))
