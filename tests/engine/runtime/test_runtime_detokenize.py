import json

import pytest

from engine.runtime.detokenize import Detokenizer, IncrementalDecoder, eos_token_ids, held_suffix


class CharTok:
    """A toy tokenizer: id i -> VOCAB[i]; id 0 is a special token."""

    VOCAB = ["<eos>", "a", "b", "c", " ", "S", "T", "O", "P", "x"]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))

    def ids(self, text):
        return [self.VOCAB.index(c) for c in text]


class ByteTok:
    """A toy byte-level tokenizer: ids are bytes; decoding replaces broken UTF-8."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def run(det, ids):
    out, stopped = [], False
    for t in ids:
        d = det.push(t)
        out.append(d.text)
        if d.stopped:
            stopped = True
            break
    if not stopped:
        out.append(det.finish())
    return out, stopped


def test_multibyte_characters_never_show_half():
    text = "héllo wörld 🙂 日本"
    ids = list(text.encode())
    dec = IncrementalDecoder(ByteTok())
    deltas = [dec.push(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert deltas[-2:] == ["", "本"]  # 3-byte char: shown when the last byte arrives


def test_real_bpe_tokenizer_round_trips(demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir("demo"))
    text = "Hello there, wörld! 🙂 The robot sang: 日本語 ...  spaces   kept."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    det = Detokenizer(tok, prompt)
    deltas, _ = run(det, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_stop_string_truncates_and_stops():
    tok = CharTok()
    det = Detokenizer(tok, stop=("STOP",))
    deltas, stopped = run(det, tok.ids("abc STOPxx"))
    assert stopped and "".join(deltas) == "abc "


def test_stop_prefix_is_held_then_released():
    tok = CharTok()
    det = Detokenizer(tok, stop=("STOP",))
    deltas = [det.push(t).text for t in tok.ids("aSTO")]
    assert "".join(deltas) == "a"  # "STO" may start "STOP": held
    assert det.push(tok.ids("x")[0]).text == "STOx"  # it did not
    assert det.finish() == ""


def test_held_text_is_flushed_at_the_end():
    tok = CharTok()
    det = Detokenizer(tok, stop=("STOP",))
    deltas, stopped = run(det, tok.ids("abST"))
    assert not stopped and "".join(deltas) == "abST"


def test_earliest_of_several_stops_wins():
    tok = CharTok()
    det = Detokenizer(tok, stop=("OP", "b c"))
    deltas, stopped = run(det, tok.ids("ab cSTOP"))
    assert stopped and "".join(deltas) == "a"


def test_eos_stops_without_text():
    tok = CharTok()
    det = Detokenizer(tok, eos_ids=[0])
    deltas, stopped = run(det, [1, 2, 0, 3])
    assert stopped and "".join(deltas) == "ab"


def test_held_suffix():
    assert held_suffix("xxST", ("STOP",)) == 2
    assert held_suffix("xxS", ("STOP", "SA")) == 1
    assert held_suffix("abc", ("STOP",)) == 0


def test_eos_ids_from_configs(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))

    class T:
        eos_token_id = 11

    assert eos_token_ids(tmp_path, T()) == {5, 7, 9, 11}
    assert eos_token_ids(tmp_path / "missing") == frozenset()


def test_push_after_stop_is_an_error():
    det = Detokenizer(CharTok(), eos_ids=[0])
    det.push(0)
    with pytest.raises(RuntimeError):
        det.push(1)
