"""Small validation helpers shared by the message modules.

Field types are msgspec's to check (on decode); these helpers state the rules
types cannot say, on values already of their field's type."""

from __future__ import annotations

import math

from msgspec.structs import force_setattr

from engine.protocol.errors import ProtocolError


def require(cond: bool, why: str) -> None:
    """Raise ProtocolError(why) unless cond holds."""
    if not cond:
        raise ProtocolError(why)


def is_text(v: str, max_chars: int, *, allow_empty: bool = True) -> bool:
    """A str within a length bound."""
    return (allow_empty or len(v) > 0) and len(v) <= max_chars


def in_range(v: float, low: float, high: float) -> bool:
    """low <= v <= high, and finite (NaN fails every comparison; an infinity fails the bound)."""
    return low <= v <= high and math.isfinite(v)


def set_float(obj: object, name: str) -> None:
    """Store an int given for a float field as a float, so a message built in
    code equals (and has the same types as) its decoded copy."""
    v = getattr(obj, name)
    if type(v) is int:
        force_setattr(obj, name, float(v))


def float_tuple(obj: object, name: str) -> None:
    """set_float for a tuple[float, ...] field."""
    v = getattr(obj, name)
    if any(type(x) is not float for x in v):
        force_setattr(obj, name, tuple(float(x) for x in v))
