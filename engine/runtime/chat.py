"""Prompt ids for a request: the tokenizer's chat template for chat turns,
plain tokenizing for raw prompts.

A model without a chat template gets FALLBACK_TEMPLATE (ChatML:
`<|im_start|>role\\ncontent<|im_end|>\\n` per turn, then
`<|im_start|>assistant\\n`) unless the caller asks for a strict error.
Base models were not trained on any template, so their chat answers are only
as good as the model's guess; raw prompts are the better path for them.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from engine.protocol.messages import ChatMessage

log = logging.getLogger(__name__)

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The model has no chat template (and the fallback was not allowed)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer: Any, messages: Iterable[ChatMessage], fallback: bool = True) -> list[int]:
    """Token ids of the templated conversation, ending with the assistant's
    generation prompt (add_generation_prompt=True)."""
    turns = [{"role": m.role, "content": m.content} for m in messages]
    template = None
    if not has_chat_template(tokenizer):
        if not fallback:
            raise ChatTemplateError(
                "this model has no chat template; send a raw prompt instead, "
                "or allow the ChatML fallback template")
        log.warning("model has no chat template; using the ChatML fallback")
        template = FALLBACK_TEMPLATE
    out = tokenizer.apply_chat_template(turns, chat_template=template, add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return _flat(out["input_ids"])


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Raw prompt: plain tokenizing with the tokenizer's special tokens (BOS...)."""
    return _flat(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def _flat(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
