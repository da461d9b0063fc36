"""The "io" record of a benchmark that reads through unbuffered stores (bench moe, bench
sparse): which read mode was asked for and which was in effect, and refusing every speedup
figure when unbuffered reads were asked for but the page cache was in play.
"""

from __future__ import annotations

from typing import Any


def io_figures(requested_direct: bool, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The "io" record of a benchmark from the `io_info()` of every store it read through:
    requested = this OS's unbuffered mode ("o_direct" on Linux, "no_buffering" on Windows,
    "f_nocache" on macOS) or "buffered"; effective = that mode only if every store really
    read unbuffered, else "buffered"."""
    from engine.platform.pread import unbuffered_mode

    reasons = [i["fallback_reason"] for i in infos if i.get("fallback_reason")]
    modes = {i["effective"] for i in infos}
    direct = requested_direct and bool(infos) and "buffered" not in modes and len(modes) == 1
    return {"requested": unbuffered_mode() if requested_direct else "buffered",
            "effective": modes.pop() if direct else "buffered",
            "fallback_reason": reasons[0] if reasons else None}


def speedup_refusal(io: dict[str, Any]) -> str | None:
    """Why no speedup may be reported (unbuffered reads requested, not in effect), or None."""
    from engine.platform.pread import LABELS

    if io["requested"] != "buffered" and io["effective"] == "buffered":
        return (f"{LABELS.get(io['requested'], io['requested'])} was requested but reads were buffered "
                f"({io['fallback_reason'] or 'unknown reason'}): the figures include the page cache, "
                "so no speedup is reported")
    return None


def refuse_speedups(figures: dict[str, Any], reason: str) -> None:
    """Null every speedup figure (any key containing "speedup", at any depth, in lists too; goals are
    targets and stay) and record why in `speedup_refused`."""
    def walk(d: dict[str, Any]) -> None:
        for k, v in d.items():
            if k.startswith("goal"):
                continue
            if "speedup" in k:
                d[k] = None
            elif isinstance(v, dict):
                walk(v)
            elif isinstance(v, list):  # rows of a table (e.g. bench sparse's thresholds)
                for item in v:
                    if isinstance(item, dict):
                        walk(item)

    walk(figures)
    figures["speedup_refused"] = reason
