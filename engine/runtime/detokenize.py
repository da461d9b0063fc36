"""Incremental detokenizing and stop handling.

Text deltas are computed the way vLLM and TGI do: decode a short window of
ids twice, ids[prefix:read] (already shown) and ids[prefix:] (with the new
ones), and show the difference. Decoding a window rather than single tokens
keeps the spaces that SentencePiece/byte-level decoders attach to
neighbouring tokens; a window that ends in U+FFFD (a byte-level piece of a
multi-byte character that is not complete yet) is held until the character
completes. The window starts with the last few prompt ids so that the first
answer token decodes with its real left context.

Stop strings: text that might be the start of a stop string is held back;
when a stop string appears, the answer ends just before it (finish "stop").
An end-of-sequence token also ends the answer with "stop"; its text is never
shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

PROMPT_CONTEXT = 5  # prompt ids kept as left context for the first answer tokens
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Delta:
    text: str  # new text to show (may be "" while held back)
    stopped: bool  # True when this token ended the answer (EOS or a stop string)


class IncrementalDecoder:
    """Turns token ids, one at a time, into text deltas (no stop handling)."""

    def __init__(self, tokenizer: Any, prompt_ids: Iterable[int] = ()) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids)[-PROMPT_CONTEXT:]
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # ids before this were already shown

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        shown = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) > len(shown) and not full.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(shown):]
        return ""

    def flush(self) -> str:
        """Text still pending at the end (an incomplete character shows as U+FFFD)."""
        shown = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(shown):] if len(full) > len(shown) else ""


def held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Detokenizer:
    """IncrementalDecoder + EOS ids + stop strings: push a token, get a Delta."""

    def __init__(self, tokenizer: Any, prompt_ids: Iterable[int] = (),
                 stop: tuple[str, ...] = (), eos_ids: Iterable[int] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self.stops = tuple(s for s in stop if s)
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.text = ""  # every decoded character of the answer so far
        self.sent = 0  # characters of self.text already shown
        self.done = False

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (for logprobs): special tokens keep their text here."""
        return self.decoder.tok.decode([int(token_id)], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> Delta:
        if self.done:
            raise RuntimeError("the answer already ended")
        if int(token_id) in self.eos_ids:
            return self._finish(self.decoder.flush())
        before = len(self.text)
        self.text += self.decoder.push(token_id)
        if self.stops:
            hit = self._find_stop(max(0, before - max(map(len, self.stops)) + 1))
            if hit is not None:
                self.done = True
                out, self.sent = self.text[self.sent:hit], hit
                self.text = self.text[:hit]
                return Delta(out, True)
        end = len(self.text) - held_suffix(self.text, self.stops) if self.stops else len(self.text)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return Delta(out, False)

    def finish(self) -> str:
        """The answer ended for another reason (length, ...): the held text."""
        return "" if self.done else self._finish(self.decoder.flush()).text

    def _finish(self, tail: str) -> Delta:
        self.text += tail
        if self.stops:  # the tail itself may complete a stop string
            hit = self._find_stop(max(0, self.sent - max(map(len, self.stops)) + 1))
            if hit is not None:
                self.text = self.text[:max(hit, self.sent)]
        self.done = True
        out, self.sent = self.text[self.sent:], len(self.text)
        return Delta(out, True)

    def _find_stop(self, start: int) -> int | None:
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None


def eos_token_ids(model_path: Path, tokenizer: Any = None) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json, then config.json, plus the
    tokenizer's eos token (chat models often end turns with it)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.exists():
            try:
                ids |= _as_ids(json.loads(f.read_text(encoding="utf-8")).get("eos_token_id"))
            except (OSError, ValueError):
                pass
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _as_ids(v: object) -> set[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return {v}
    if isinstance(v, list):
        return {x for x in v if isinstance(x, int) and not isinstance(x, bool)}
    return set()
