"""The OpenVINO backend: export on first use, compile with a blob cache, one
InferRequest (own KV state) per stream.

Cache layout, under <FLOTILLA_CACHE or the user cache folder>/ov/:
  <name>-<fingerprint>-ov<openvino>-oi<optimum-intel>/   the exported IR
  compiled/                                            OpenVINO's CACHE_DIR
An export is written to a temporary folder and renamed into place, so an
interrupted export leaves nothing behind. A folder that already holds
openvino_model.xml is used as is.

Precision: "default" leaves the plugin's choice (on CPUs with bf16/AMX that is
bf16 math and a u8 KV cache: fastest, not bit-exact); "f32" forces f32 math
and an f32 KV cache (what the equivalence tests use); "f16"/"bf16" force
those inference precisions.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.runtime.backend import Progress
from engine.runtime.errors import BackendError

IR_NAME = "openvino_model.xml"
PRECISIONS = ("default", "f32", "f16", "bf16")
VIRTUAL_DEVICES = ("AUTO", "MULTI", "HETERO", "BATCH")


@dataclass(frozen=True)
class OVConfig:
    device: str = "CPU"  # CPU, GPU, GPU.1, NPU, AUTO, ... (checked against the Core)
    precision: str = "default"  # see the module doc
    cache_root: Path | None = None  # None = <FLOTILLA_CACHE or user cache>/ov
    prefill_chunk: int = 512  # prompt tokens per infer call (bounds peak memory)


def ov_cache_root() -> Path:
    env = os.environ.get("FLOTILLA_CACHE")
    if env:
        return Path(env) / "ov"
    import platformdirs

    return Path(platformdirs.user_cache_dir("flotilla", appauthor=False)) / "ov"


def is_ir_folder(path: Path) -> bool:
    return (Path(path) / IR_NAME).exists()


def model_fingerprint(src: Path) -> str:
    """Cheap identity of an HF folder: config.json bytes + name, size and
    mtime of every file (weights are not hashed: they can be many GB)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(src).iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        if f.name == "config.json":
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def export_dir(src: Path, root: Path | None = None) -> Path:
    import openvino as ov

    ov_ver = ov.__version__.split("-")[0]
    oi_ver = metadata.version("optimum-intel")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(src).name)[:48]
    return (root or ov_cache_root()) / f"{name}-{model_fingerprint(src)}-ov{ov_ver}-oi{oi_ver}"


@contextlib.contextmanager
def _quiet():
    """Silence the warnings, logs and progress bars of torch tracing and export."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    saved = {n: logging.getLogger(n).level for n in ("optimum", "nncf", "torch")}
    for n in saved:
        logging.getLogger(n).setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield sink
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)


def ensure_ir(src: Path, root: Path | None = None, progress: Progress | None = None) -> Path:
    """The IR folder for src: src itself if it is one, else the cached export
    (exported now if missing)."""
    src = Path(src)
    if is_ir_folder(src):
        return src
    if not (src / "config.json").exists():
        raise BackendError(f"{src} is neither a Hugging Face model folder nor an OpenVINO IR folder")
    target = export_dir(src, root)
    if (target / IR_NAME).exists():
        return target
    report = progress or (lambda _m, _f: None)
    report(f"exporting {src.name} to OpenVINO (once)", 0.05)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        from optimum.exporters.openvino import main_export

        with _quiet() as log_text:
            try:
                main_export(str(src), output=str(tmp), task="text-generation-with-past", stateful=True)
            except Exception as e:
                tail = " | ".join(log_text.getvalue().strip().splitlines()[-3:])
                raise BackendError(f"OpenVINO export of {src.name} failed: {e}"
                                   + (f" ({tail})" if tail else "")) from e
        if not (tmp / IR_NAME).exists():
            raise BackendError(f"OpenVINO export of {src.name} produced no {IR_NAME}")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / IR_NAME).exists():  # else another process won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report("export done", 0.6)
    return target


def check_device(core, device: str) -> str:
    """Validate a device name against the machine; return it upper-cased."""
    dev = device.strip().upper()
    available = list(core.available_devices)  # e.g. ["CPU", "GPU.0", "GPU.1"]
    bases = {d.split(".")[0] for d in available}
    if dev.split(":")[0] in VIRTUAL_DEVICES or dev in available or dev in bases:
        return dev
    raise BackendError(f"OpenVINO device {device!r} is not available here; "
                       f"available: {', '.join(available) or 'none'} (or AUTO)")


def compile_config(device: str, precision: str, cache_dir: Path) -> dict[str, str]:
    if precision not in PRECISIONS:
        raise BackendError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    cfg = {"CACHE_DIR": str(cache_dir)}
    if precision != "default":
        cfg["INFERENCE_PRECISION_HINT"] = precision
        if precision == "f32" and device.split(".")[0] in ("CPU", "GPU"):
            cfg["KV_CACHE_PRECISION"] = "f32"
    return cfg


class OVStream:
    """One request's view of the model: its own InferRequest and KV state."""

    def __init__(self, compiled, input_names: set[str], chunk: int) -> None:
        self.req = compiled.create_infer_request()
        self.req.reset_state()
        self.names = input_names
        self.chunk = chunk
        self.past = 0  # tokens in the KV state

    def _run(self, ids: np.ndarray) -> np.ndarray:
        n = ids.shape[1]  # ids: [1, n] int64
        feed = {"input_ids": ids}
        if "attention_mask" in self.names:
            feed["attention_mask"] = np.ones((1, self.past + n), dtype=np.int64)
        if "position_ids" in self.names:
            feed["position_ids"] = np.arange(self.past, self.past + n, dtype=np.int64)[None]
        if "beam_idx" in self.names:
            feed["beam_idx"] = np.zeros(1, dtype=np.int32)
        self.req.infer(feed)
        self.past += n
        logits = self.req.get_tensor("logits").data  # [1, n, vocab]
        return np.array(logits[0, -1], dtype=np.float32)  # [vocab], a copy

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)  # [1, n]
        if arr.shape[1] == 0:
            raise ValueError("prefill needs at least one token")
        logits = None
        for start in range(0, arr.shape[1], self.chunk):
            logits = self._run(arr[:, start:start + self.chunk])
        return logits

    def decode(self, token: int) -> np.ndarray:
        return self._run(np.array([[token]], dtype=np.int64))

    def close(self) -> None:
        self.req = None


class OVModel:
    """An exported, compiled OpenVINO model; new_stream() per request."""

    def __init__(self, source: Path, config: OVConfig = OVConfig(),
                 progress: Progress | None = None) -> None:
        import openvino as ov

        report = progress or (lambda _m, _f: None)
        core = ov.Core()
        self.device = check_device(core, config.device)
        root = config.cache_root or ov_cache_root()
        self.cache_dir = root / "compiled"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cfg = compile_config(self.device, config.precision, self.cache_dir)
        self.model_dir = ensure_ir(Path(source), root, report)
        report(f"compiling for {self.device}", 0.7)
        try:
            self.compiled = core.compile_model(str(self.model_dir / IR_NAME), self.device, cfg)
        except Exception as e:
            raise BackendError(f"compiling {self.model_dir.name} for {self.device} failed: {e}") from e
        self.input_names = {n for i in self.compiled.inputs for n in i.get_names()}
        if "input_ids" not in self.input_names or "logits" not in {
                n for o in self.compiled.outputs for n in o.get_names()}:
            raise BackendError(f"{self.model_dir} is not a causal-LM IR (needs input_ids -> logits)")
        self.chunk = config.prefill_chunk
        report("model ready", 1.0)

    def new_stream(self) -> OVStream:
        return OVStream(self.compiled, self.input_names, self.chunk)

    def close(self) -> None:
        self.compiled = None
