"""What every part of the facade shares: the progress callback type and one-line errors."""

from __future__ import annotations

from typing import Callable


Progress = Callable[[str, float], None]  # (what is happening, fraction 0..1)


def one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:300]
