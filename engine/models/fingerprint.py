"""The one identity of a model folder: what every cache keyed by a model (OpenVINO exports,
pipeline shards, the MoE expert store) is keyed by.

The same on every machine (an agent and its controller compare shards by it, so file
times cannot be in it), and cheap on a multi-GB checkpoint (hashing every byte would take
minutes): config.json, a demo's recipe fingerprint, the tokenizer and generation files
(their name, size and first MiB), and for each weight file its name,
size, first MiB (the safetensors header: tensor names, shapes, offsets) and last MiB,
plus the first 4 KiB of every tensor of a safetensors file -- so a fine-tune saved over
the same files (a merged LoRA that leaves the embeddings and the head alone) is a new
model, while copying or touching the files is not.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

EDGE_BYTES = 1 << 20  # read at each end of a weight file
TENSOR_SAMPLE_BYTES = 4096  # read at the start of each tensor of a safetensors file
TOKENIZER_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")  # tokenizer, chat template, settings
_MAX_HEADER = 100 << 20


_SEEN: dict[tuple, str] = {}  # (folder, its files' names, sizes and times) -> fingerprint


def model_fingerprint(model_path: Path | str) -> str:
    """The folder's fingerprint; read once per process while its files stay as they were (a
    launch asks for it to resolve, export and key the shards of the same model)."""
    model_path = Path(model_path)
    files = sorted(p for p in model_path.iterdir() if p.is_file())
    key = (str(model_path.resolve()), tuple((p.name, *_stamp(p)) for p in files))
    if key not in _SEEN:
        _SEEN[key] = _read_fingerprint(model_path, files)
    return _SEEN[key]


def _stamp(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns


def _read_fingerprint(model_path: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    h.update((model_path / "config.json").read_bytes())
    demo = model_path / "flotilla-demo.json"
    if demo.exists():
        h.update(json.loads(demo.read_text()).get("fingerprint", "").encode())
    for p in files:  # the tokenizer and generation settings are the model too
        if p.suffix in TOKENIZER_SUFFIXES and p.name != "config.json":
            h.update(f"{p.name}:{p.stat().st_size}".encode())
            with open(p, "rb") as f:
                h.update(f.read(EDGE_BYTES))
    for p in (p for p in files if p.suffix in (".safetensors", ".bin")):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(EDGE_BYTES))
            f.seek(max(0, size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
            if p.suffix == ".safetensors":
                _hash_tensor_starts(f, size, h)
    return h.hexdigest()[:20]


def _hash_tensor_starts(f, size: int, h) -> None:
    """The first TENSOR_SAMPLE_BYTES of every tensor, in file order (a malformed header: none)."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        return
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        return
    try:
        header = json.loads(f.read(n))
    except ValueError:
        return
    starts = sorted(int(v["data_offsets"][0]) for k, v in header.items()
                    if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
    for start in starts:
        f.seek(8 + n + start)
        h.update(f.read(TENSOR_SAMPLE_BYTES))
