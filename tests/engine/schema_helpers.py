"""JSON schemas a random-weight model cannot run past: every string has an enum or a
maxLength, every integer a minimum and maximum, every array a maxItems, every object
additionalProperties false. So an answer held to one must end, and must validate,
whatever the weights say (the constraint alone makes it valid)."""

from __future__ import annotations

import random
from typing import Any


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["enum", "string", "integer", "boolean", "null_or_int", "const"])
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "Oslo", "Rome", "a b", "x\"y"], 3)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null_or_int":
        return {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}
    return {"const": rng.choice(["v1", 3, True])}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return bounded_object(rng, depth + 1)
    if depth < 2 and roll < 0.45:
        return {"type": "array", "items": _leaf(rng), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def bounded_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    n = rng.randint(1, 4)
    props = {f"k{i}_{rng.choice(['id', 'name', 'n', 'ok'])}": _node(rng, depth) for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def bounded_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [bounded_object(rng) for _ in range(n)]
