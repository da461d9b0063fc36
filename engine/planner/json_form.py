"""The plan types' JSON form: building a frozen plan dataclass from its dict."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from engine.planner.memory import _need


def _from_dict(cls: type, d: Mapping[str, Any], **convert: Any) -> Any:
    """Build cls from a dict with exactly its fields; convert maps field -> fn."""
    _need(isinstance(d, Mapping), f"{cls.__name__} must be an object")
    names = [f.name for f in fields(cls)]
    extra = sorted(set(d) - set(names))
    _need(not extra, f"{cls.__name__}: unknown field(s) {', '.join(map(str, extra))}")
    kw = {k: (convert[k](v) if k in convert else v) for k, v in d.items()}
    try:
        return cls(**kw)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{cls.__name__}: {e}") from None


def _tuple_of(item: Any) -> Any:
    def conv(v: Any) -> tuple:
        _need(isinstance(v, (list, tuple)), "expected a list")
        return tuple(item(x) for x in v)

    return conv
