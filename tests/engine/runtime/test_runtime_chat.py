import pytest
from transformers import AutoTokenizer

from engine.protocol.messages import ChatMessage
from engine.runtime.chat import ChatTemplateError, chat_ids, prompt_ids

MSGS = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"))


@pytest.fixture(scope="module")
def tok(demo_dir):
    return AutoTokenizer.from_pretrained(demo_dir("demo"))


def test_chat_template_with_generation_prompt(tok):
    ids = chat_ids(tok, MSGS)
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_fallback_template_and_strict_error(tok):
    templated = chat_ids(tok, MSGS)
    saved, tok.chat_template = tok.chat_template, None
    try:
        assert chat_ids(tok, MSGS) == templated  # the fallback is ChatML, like the demo template
        with pytest.raises(ChatTemplateError, match="no chat template"):
            chat_ids(tok, MSGS, fallback=False)
    finally:
        tok.chat_template = saved


def test_raw_prompt(tok):
    assert tok.decode(prompt_ids(tok, "Once upon a time")) == "Once upon a time"
