"""A grammar held over an answer: before each pick, every token that would leave it
gets -inf; after each pick, the grammar moves on; when it is complete, the answer ends.

The grammar comes from the request (grammar_for): its JSON schema (response_format),
or a forced tool call in the model's call format (engine/runtime/tool_format.py) with
each tool's parameters schema. llguidance compiles it lazily against the tokenizer's
vocabulary and computes the allowed set per token (a bitmask); it was chosen over
xgrammar and outlines-core because it needs no torch or triton at run time, ships one
abi3 wheel per OS (Windows included), and handles JSON schema and Lark alike.

The JSON it allows has one space after ':' and ',' and no other whitespace: a model
(a random one especially) cannot spend its whole answer on newlines, and a forced call
streams with a predictable head (tool_format.ForcedCallReader).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from engine.protocol.messages import GenerateRequest
from engine.runtime.errors import RequestError
from engine.runtime.tool_format import ITEM_SEPARATOR, KEY_SEPARATOR, ToolFormat

# llguidance's JSON options: the separators above, no free whitespace
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}
ANY_OBJECT = '{"type": "object"}'  # response_format json_object

_tokenizers: "weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]]" = weakref.WeakKeyDictionary()


class GrammarError(RequestError):
    """A schema or grammar llguidance cannot compile (a 400 at the API)."""


def _styled(schema_text: str) -> dict:
    schema = json.loads(schema_text)
    return {**schema, "x-guidance": {**_JSON_STYLE, **schema.get("x-guidance", {})}}


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def grammar_for(request: GenerateRequest, fmt: ToolFormat) -> str | None:
    """The llguidance grammar an answer to `request` must follow, or None (free text)."""
    if not request.constrained:
        return None  # free text: llguidance is not even imported
    import llguidance

    if request.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_styled(request.json_schema)))
    tools = [t for t in request.tools if request.forced_tool in (None, t.name)]
    rules = [f"call{i}: {_lark_literal(fmt.head(t.name))} %json {json.dumps(_styled(t.parameters))} "
             f"{_lark_literal(fmt.tail)}" for i, t in enumerate(tools)]
    start = "start: " + " | ".join(f"call{i}" for i in range(len(tools)))
    return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n")


def check_grammar(grammar: str) -> None:
    """GrammarError with llguidance's one-line reason when `grammar` does not compile."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise GrammarError(" ".join(error.split())[:300])


def _ll_tokenizer(tokenizer: Any, eos_ids: frozenset[int]) -> Any:
    """llguidance's view of the vocabulary: built once per tokenizer (for a 128 k
    vocabulary it takes a noticeable fraction of a second)."""
    import llguidance.hf

    eos = tuple(sorted(eos_ids))
    per = _tokenizers.setdefault(tokenizer, {})
    if eos not in per:
        per[eos] = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos) or None)
    return per[eos]


class Constraint:
    """One answer's grammar state: mask the next pick, then advance by the token picked."""

    def __init__(self, grammar: str, tokenizer: Any, eos_ids: frozenset[int]) -> None:
        import llguidance
        import llguidance.numpy as lln

        self._lln = lln
        ll_tok = _ll_tokenizer(tokenizer, eos_ids)
        self.vocab = int(ll_tok.vocab_size)
        self.matcher = llguidance.LLMatcher(ll_tok, grammar)
        if self.matcher.is_error():
            raise GrammarError(" ".join(self.matcher.get_error().split())[:300])
        self._bits = lln.allocate_token_bitmask(1, self.vocab)  # [1, ceil(vocab / 32)] int32

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the logits row [width >= vocab] with every token the grammar
        does not allow next at -inf."""
        self._lln.fill_next_token_bitmask(self.matcher, self._bits, 0)
        if self.matcher.is_error():
            raise ValueError(f"the answer's grammar failed: {self.matcher.get_error()}")
        row = np.array(logits, dtype=np.float32, copy=True)  # [width]
        self._lln.apply_token_bitmask_inplace(row[None, :self.vocab], self._bits)
        row[self.vocab:] = -np.inf  # padding columns of the head are never tokens
        return row

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} breaks the answer's grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar has nothing more to add: the answer ends here."""
        return bool(self.matcher.is_stopped())


def for_request(request: GenerateRequest, tokenizer: Any, eos_ids: frozenset[int],
                fmt: ToolFormat) -> Constraint | None:
    grammar = grammar_for(request, fmt)
    return None if grammar is None else Constraint(grammar, tokenizer, eos_ids)
