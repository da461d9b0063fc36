"""Model references: turn what the user typed into a validated model folder.

A spec is, in this order of precedence:
  1. a demo id (`demo`, `demo-qwen3`, ...): built into the cache if missing;
  2. an existing local path: a Hugging Face folder or an OpenVINO IR folder
     (a local folder named like `org/name` wins over the hub id of that name);
  3. a hub id `org/name`: used from the standard Hugging Face cache, or
     downloaded into it.
Anything else is reported as a missing path.

Validation is cheap and read-only: it parses config.json and the safetensors
headers (never the weights) so that a truncated copy or a BERT checkpoint is
reported in one clear line before any engine spends minutes exporting it.
Nothing is ever written into a user's folder.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.models import demo
from engine.models.errors import ModelError
from engine.models.fingerprint import model_fingerprint

Progress = Callable[[str, float], None]

# The file names that make a folder usable; kept here so catalog and profile agree.
CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_WEIGHTS = "pytorch_model.bin"
PYTORCH_INDEX = "pytorch_model.bin.index.json"
OPENVINO_XML = "openvino_model.xml"
OPENVINO_BIN = "openvino_model.bin"
# Any one of these means a tokenizer can be loaded (fast, sentencepiece, BPE
# vocab files, tiktoken, or the OpenVINO tokenizer written by optimum-intel).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "tokenizer.tiktoken", "qwen.tiktoken", "openvino_tokenizer.xml")

# A hub id is exactly `org/name` made of the characters the hub allows.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Bytes per element of safetensors dtypes; sub-byte types (F4...) are absent
# and skip the per-tensor size check.
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
               "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}

# A safetensors header is JSON metadata; anything bigger than this is garbage.
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class ResolvedModel:
    """A validated model folder and how it was found."""

    spec: str  # exactly what the user typed
    model_id: str  # display name: demo id, folder name or hub id
    path: Path  # the folder holding config.json, weights and tokenizer
    kind: str  # "demo" | "hf" | "openvino" | "hub"
    architecture: str  # config "architectures"[0], else model_type
    fingerprint: str  # short content hash; keys export caches
    weights_format: str = "safetensors"  # "safetensors" | "pytorch" | "openvino"


def resolve_model(spec: str, progress: Progress | None = None,
                  allow_download: bool = True) -> ResolvedModel:
    """Resolve a demo id, local folder or hub id to a validated model folder."""
    spec = spec.strip() if isinstance(spec, str) else spec
    if not spec:
        raise ModelError("no model given; pass a demo id (" + ", ".join(demo.demo_ids())
                         + "), a model folder or a hub id like Qwen/Qwen3-0.6B")
    if demo.is_demo_id(spec):
        path = demo.ensure_demo(spec, progress)
        try:
            return _resolve_folder(spec, spec, path, "demo")
        except ModelError as e:
            raise ModelError(f"{e} (demo cache damaged: delete {path} and it will be rebuilt)") from None
    local = Path(spec).expanduser()
    if local.exists() or not _HUB_ID.match(spec):
        folder = local.resolve() if local.exists() else local.absolute()
        return _resolve_folder(spec, folder.name or str(folder), folder, None)
    return _resolve_hub(spec, progress, allow_download)


# --------------------------------------------------------------------------- folders

def _resolve_folder(spec: str, model_id: str, path: Path, kind: str | None) -> ResolvedModel:
    config = check_folder(path)
    fmt, weights = _check_weights(path)
    _check_tokenizer(path)
    if kind is None:
        kind = "openvino" if fmt == "openvino" else "hf"
    return ResolvedModel(spec=spec, model_id=model_id, path=path, kind=kind,
                         architecture=architecture_of(config),
                         fingerprint=model_fingerprint(path), weights_format=fmt)


def check_folder(path: Path) -> dict[str, Any]:
    """Check the folder and its config.json; return the parsed config."""
    if not path.exists():
        raise ModelError(f"model not found: {path} does not exist; pass a model folder, a demo id ("
                         + ", ".join(demo.demo_ids()) + ") or a hub id like Qwen/Qwen3-0.6B")
    if not path.is_dir():
        raise ModelError(f"{path} is a file, not a model folder; pass the folder that holds "
                         "config.json, the weights and the tokenizer")
    try:
        entries = list(path.iterdir())
    except OSError as e:
        raise ModelError(f"cannot read folder {path}: {e.strerror or e}; check its permissions") from None
    if not entries:
        raise ModelError(f"{path} is an empty folder; copy the model files (config.json, "
                         "weights, tokenizer) into it")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        hint = "pass the folder that holds config.json"
        nested = sorted(p.parent for p in path.glob(f"*/{CONFIG_FILE}"))
        if nested:
            hint = f"did you mean {nested[0]}?"
        elif any(p.suffix == ".gguf" for p in entries):
            hint = "GGUF files are not supported; use the original safetensors model"
        raise ModelError(f"{path} is not a Hugging Face model folder: no config.json; {hint}")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read {cfg_file}: {e}; re-copy the model") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_file} is not valid JSON ({e.msg} at line {e.lineno}); "
                         "re-download or re-copy the model") from None
    if not isinstance(config, dict):
        raise ModelError(f"{cfg_file} is not a model config (expected a JSON object); "
                         "re-download or re-copy the model")
    _check_causal_lm(path, config)
    return config


def architecture_of(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs and isinstance(archs[0], str):
        return archs[0]
    return str(config.get("model_type") or "unknown")


def _check_causal_lm(path: Path, config: dict[str, Any]) -> None:
    archs = [a for a in (config.get("architectures") or []) if isinstance(a, str)]
    model_type = config.get("model_type")
    # Fast path: the common case needs no transformers import (which pulls in torch).
    if any(a.endswith("ForCausalLM") for a in archs):
        return
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
        causal_classes = set(causal.values())
        causal_types = set(causal)
    except Exception:  # a broken transformers must not hide a clear verdict
        causal_classes, causal_types = set(), set()
    if archs:
        # Architectures win over model_type: a "bert" BertModel checkpoint has
        # model_type bert, which the mapping lists (BertLMHeadModel), yet no LM head.
        if any(a in causal_classes or a.endswith("LMHeadModel") for a in archs):
            return
    elif model_type in causal_types:
        return
    what = archs[0] if archs else f"model_type {model_type or 'unknown'}"
    if archs and model_type:
        what += f" (model_type {model_type})"
    raise ModelError(f"{path} holds {what}, not a causal language model; Flotilla runs "
                     "text-generation models (…ForCausalLM), pick one of those")


def _check_weights(path: Path) -> tuple[str, list[Path]]:
    """Find and cheaply validate the weight files; return (format, files)."""
    if (path / OPENVINO_XML).is_file():
        if not (path / OPENVINO_BIN).is_file():
            raise ModelError(f"{path} has {OPENVINO_XML} but no {OPENVINO_BIN}; copy the .bin file too")
        # The IR is parsed by OpenVINO at load time; deep checks here would cost seconds.
        return "openvino", [path / OPENVINO_XML, path / OPENVINO_BIN]
    files = safetensors_files(path)
    if files:
        for f in files:
            read_safetensors_header(f)
        return "safetensors", files
    bins = _pytorch_files(path)
    if bins:
        return "pytorch", bins
    hint = ("GGUF files are not supported; use the original safetensors model"
            if any(path.glob("*.gguf")) else "copy the weight files too")
    raise ModelError(f"{path} has no weights (model.safetensors, {PYTORCH_WEIGHTS} or "
                     f"{OPENVINO_XML}/.bin); {hint}")


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a folder, every shard of an index checked present."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        return _shards(path, index)
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    return [f for f in files if f.is_file()]


def _pytorch_files(path: Path) -> list[Path]:
    index = path / PYTORCH_INDEX
    if index.is_file():
        return _shards(path, index)
    files = sorted(path.glob("pytorch_model*.bin"))
    for f in files:
        if f.stat().st_size == 0:
            raise ModelError(f"{f} is empty (0 bytes); re-download or re-copy it")
    return files


def _shards(path: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelError(f"{index} is not a valid shard index; re-download or re-copy it") from None
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ModelError(f"{path} is missing {len(missing)} of {len(names)} weight shards "
                         f"(first: {missing[0]}); copy every shard listed in {index.name}")
    return [path / n for n in names]


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """Parse and check a safetensors header without reading the tensors.

    Layout: 8-byte little-endian header length n, n bytes of JSON, then the
    tensor data; each tensor's data_offsets are relative to the data start.
    A complete file is exactly 8 + n + max(end) bytes long.
    """
    bad = f"re-download or re-copy {file.name}"
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelError(f"{file} is truncated ({size} bytes, no safetensors header); {bad}")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER or 8 + n > size:
                raise ModelError(f"{file} is truncated or corrupted (header length {n}, "
                                 f"file {size} bytes); {bad}")
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as e:
        raise ModelError(f"cannot read {file}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelError(f"{file} is corrupted (its safetensors header is not valid JSON); {bad}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{file} is corrupted (its safetensors header is not a JSON object); {bad}")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{file} is corrupted (bad entry for tensor {name}); {bad}") from None
        numel = 1
        for d in shape:
            numel *= d
        if begin < 0 or stop < begin or (dtype in DTYPE_BYTES and stop - begin != numel * DTYPE_BYTES[dtype]):
            raise ModelError(f"{file} is corrupted (tensor {name} has inconsistent offsets); {bad}")
        end = max(end, stop)
    expected = 8 + n + end
    if size < expected:
        raise ModelError(f"{file} is truncated ({size} of {expected} bytes); {bad}")
    if size > expected:
        raise ModelError(f"{file} is corrupted ({size} bytes, expected {expected}); {bad}")
    return header


def _check_tokenizer(path: Path) -> None:
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return
    raise ModelError(f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); "
                     "copy the tokenizer files from the original model too")


# --------------------------------------------------------------------------- hub

def hf_cache_dir() -> Path:
    """The standard Hugging Face hub cache, read from the environment *now*.

    huggingface_hub.constants freezes these at import time; tests and users
    that change HF_HOME later must still be honoured.
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _resolve_hub(repo_id: str, progress: Progress | None, allow_download: bool) -> ResolvedModel:
    cached = _cached_snapshot(repo_id)
    if cached is not None:
        try:
            return _resolve_folder(repo_id, repo_id, cached, "hub")
        except ModelError:
            # An incomplete snapshot (e.g. only config.json fetched by a probe):
            # download the rest when we may, else report what is wrong with it.
            if not allow_download or hub_offline():
                raise
    head = f"cannot download {repo_id}"
    local_hint = "(the model is not in the local Hugging Face cache); copy the folder here and pass its path"
    if not allow_download:
        raise ModelError(f"{head}: downloads are disabled {local_hint}")
    if hub_offline():
        raise ModelError(f"{head}: offline mode (HF_HUB_OFFLINE is set) {local_hint}")
    path = _download(repo_id, progress, head, local_hint)
    return _resolve_folder(repo_id, repo_id, path, "hub")


def _cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of the main revision, read straight from disk."""
    repo_dir = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    try:
        commit = (repo_dir / "refs" / "main").read_text().strip()
    except OSError:
        snaps = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) \
            if (repo_dir / "snapshots").is_dir() else []
        return snaps[-1] if snaps else None
    snap = repo_dir / "snapshots" / commit
    return snap if snap.is_dir() else None


# Files never needed to run a causal LM; some repos carry gigabytes of them.
_IGNORE = ["*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot", "*.tflite",
           "*.pth", "*.pt", "original/*", "onnx/*", "consolidated*", "*.mlmodel*"]


def _download(repo_id: str, progress: Progress | None, head: str, local_hint: str) -> Path:
    try:
        import httpx
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            OfflineModeIsEnabled, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as e:
        raise ModelError(f"{head}: huggingface_hub is not installed ({e})") from None
    report = progress or (lambda _m, _f: None)
    ignore = list(_IGNORE)
    try:
        info = HfApi().model_info(repo_id)
        names = [s.rfilename for s in (info.siblings or [])]
        # Older repos ship both formats; fetch the safetensors only.
        if any(n.endswith(".safetensors") for n in names):
            ignore.append("*.bin")
        report(f"downloading {repo_id}", 0.0)
        path = snapshot_download(repo_id, cache_dir=str(hf_cache_dir()), ignore_patterns=ignore,
                                 tqdm_class=_progress_bar(repo_id, report))
    except GatedRepoError:
        raise ModelError(f"{head}: the model is gated; accept its license on huggingface.co "
                         "and log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{head}: no such model on the Hugging Face hub (or it is private: "
                         "log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ModelError(f"{head}: the hub has no main revision for it") from None
    except (httpx.ConnectError, httpx.TimeoutException, OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise ModelError(f"{head}: no network {local_hint}") from None
    except HfHubHTTPError as e:
        raise ModelError(f"{head}: the hub answered {getattr(e.response, 'status_code', '?')}; "
                         "try again later") from None
    except httpx.HTTPError as e:
        raise ModelError(f"{head}: network error ({type(e).__name__}) {local_hint}") from None
    except OSError as e:
        raise ModelError(f"{head}: {e.strerror or e} while writing to {hf_cache_dir()}; "
                         "free some disk space or set HF_HOME") from None
    report(f"{repo_id} downloaded", 1.0)
    return Path(path)


def _progress_bar(repo_id: str, report: Progress):
    """A tqdm class that forwards snapshot_download's byte counter to `report`."""
    import io

    from tqdm.auto import tqdm

    class _Report(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = False  # a disabled tqdm stops counting
            kwargs["file"] = io.StringIO()
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            out = super().update(n)
            if self.unit == "B" and self.total:
                report(f"downloading {repo_id}", min(self.n / self.total, 1.0) * 0.99)
            return out

    return _Report
