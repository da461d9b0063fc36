"""The folder openvino_genai's pipelines load: an IR plus its tokenizer as IRs.

LLMPipeline and ContinuousBatchingPipeline read openvino_tokenizer.xml and
openvino_detokenizer.xml next to the model. Flotilla tokenizes with transformers,
so its IR folders have neither: `genai_folder(ir)` builds `<ir>-genai` once, the
IR's files linked (not copied: a 70B model's weights are not duplicated) and the
tokenizer converted with openvino_tokenizers.
"""

from __future__ import annotations

import os
from pathlib import Path

READY = "openvino_detokenizer.xml"  # written last: a folder without it is redone


def genai_folder(ir: Path) -> Path:
    """<ir>-genai: the IR's files linked plus the tokenizer IRs openvino_genai needs."""
    import openvino as ov

    out = ir.parent / (ir.name + "-genai")
    if (out / READY).exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in ir.iterdir():
        link = out / f.name
        if f.is_file() and not link.exists():
            os.symlink(f.resolve(), link)
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(str(ir)), with_detokenizer=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    tmp = out / ("." + READY)
    ov.save_model(detok, str(tmp))
    tmp.with_suffix(".bin").replace(out / "openvino_detokenizer.bin")
    tmp.replace(out / READY)
    return out
