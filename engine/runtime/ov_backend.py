"""The OpenVINO backend: export on first use, compile, one InferRequest (own KV state) per stream.

Cache layout, under <FLOTILLA_CACHE or the user cache folder>/ov/:
  <name>-<fingerprint>-<weights>-ov<openvino>-oi<optimum-intel>/   the exported IR
  compiled/                                      OpenVINO's CACHE_DIR (GPU/NPU only, ov_compile.py)
An export is written to a temporary folder and renamed into place, so an
interrupted export leaves nothing behind. A folder that already holds
openvino_model.xml is used as is. <weights> is the weight precision of the
export (ov_weights.py: "auto" = the checkpoint's dtype), so formats never collide.

Memory: the model holds its weights once. On CPU it is compiled straight from
the IR (no blob: ov_compile.py has the measurements), and the IR gets a
`logits_to_keep` input before the LM head (ov_logits.py), so a prefill chunk
computes the last position's logits only, as openvino_genai does. Streams
made here feed [1]; requests made by anyone else through `compiled` (the
speculative streams, which verify K+1 positions at once) start at [0] = every
position, the unsliced behaviour.

Precision: "default" leaves the plugin's choice (on CPUs with bf16/AMX that is
bf16 math and a u8 KV cache: fastest, not bit-exact); "f32" forces f32 math
and an f32 KV cache (what the equivalence tests use); "f16"/"bf16" force
those inference precisions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engine.models.fingerprint import model_fingerprint
from engine.runtime.backend import Progress
from engine.runtime.stateful_stream import StatefulStream
from engine.runtime.errors import BackendError
from engine.runtime.ov_compile import VIRTUAL_DEVICES, CompileConfigError
from engine.runtime.ov_compile import compile_config as device_compile_config
from engine.runtime.ov_logits import LOGITS_TO_KEEP, add_logits_to_keep
from engine.runtime.prompt_cache import KeptStates
from engine.runtime.ov_weights import WeightsError, checkpoint_dtype, compress_ir, export_arguments, resolve_weights

IR_NAME = "openvino_model.xml"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OVConfig:
    device: str = "CPU"  # CPU, GPU, GPU.1, NPU, AUTO, ... (checked against the Core)
    precision: str = "default"  # see the module doc
    cache_root: Path | None = None  # None = <FLOTILLA_CACHE or user cache>/ov
    prefill_chunk: int = 512  # prompt tokens per infer call (bounds peak memory)
    weights: str = "auto"  # weight precision of an export (ov_weights.py); an IR folder keeps its own
    idle_requests: int = 2  # InferRequests of finished streams kept for new ones (each keeps its buffers)


def ov_cache_root() -> Path:
    env = os.environ.get("FLOTILLA_CACHE")
    if env:
        return Path(env) / "ov"
    import platformdirs

    return Path(platformdirs.user_cache_dir("flotilla", appauthor=False)) / "ov"


def is_ir_folder(path: Path) -> bool:
    return (Path(path) / IR_NAME).exists()


def export_dir(src: Path, root: Path | None = None, weights: str = "auto") -> Path:
    """Where the export of src at `weights` ("auto" resolved to the checkpoint's dtype) lives."""
    import openvino as ov

    label = resolve_weights(src, weights)
    ov_ver = ov.__version__.split("-")[0]
    oi_ver = metadata.version("optimum-intel")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(src).name)[:48]
    return (root or ov_cache_root()) / f"{name}-{model_fingerprint(src)}-{label}-ov{ov_ver}-oi{oi_ver}"


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


def ensure_ir(src: Path, root: Path | None = None, progress: Progress | None = None,
              weights: str = "auto") -> Path:
    """The IR folder for src: src itself if it is one, else the cached export at
    `weights` (exported now if missing; "auto" = the checkpoint's own dtype)."""
    src = Path(src)
    if is_ir_folder(src):
        if weights != "auto":
            raise BackendError(f"{src.name} is an OpenVINO IR: its weights were fixed when it was exported "
                               f"(--weights {weights} needs a Hugging Face model folder)")
        return src
    if not (src / "config.json").exists():
        raise BackendError(f"{src} is neither a Hugging Face model folder nor an OpenVINO IR folder")
    try:
        label = resolve_weights(src, weights)
    except WeightsError as e:
        raise BackendError(str(e)) from None
    target = export_dir(src, root, label)
    if (target / IR_NAME).exists():
        return target
    report = progress or (lambda _m, _f: None)
    report(f"exporting {src.name} to OpenVINO, {label} weights (once)", 0.05)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        from optimum.exporters.openvino import main_export

        with _quiet() as log_text:
            try:
                main_export(str(src), output=str(tmp), task="text-generation-with-past", stateful=True,
                            **export_arguments(label, checkpoint_dtype(src)))
                compress_ir(tmp, label)
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


def compile_config(device: str, precision: str, cache_dir: Path | None) -> dict[str, str]:
    """ov_compile.compile_config, with its error as a BackendError (shown to users as is)."""
    try:
        return device_compile_config(device, precision, cache_dir)
    except CompileConfigError as e:
        raise BackendError(str(e)) from None


class OVStream:
    """One request's view of the model: its own InferRequest and KV state (a StatefulStream).

    `release(req, fed)` is called with the InferRequest and the ids it holds when the
    stream closes (the model's pool of idle requests); without one the request is simply
    dropped. A stream opened on a request that already holds the first `reuse` ids of
    this prompt (a follow-up turn) keeps their KV and prefills only the rest."""

    def __init__(self, compiled, input_names: set[str], chunk: int, req=None,
                 release: Callable[[Any, list[int]], None] | None = None,
                 reuse: int = 0, held: Sequence[int] = ()) -> None:
        self.state = StatefulStream(req if req is not None else compiled.create_infer_request(), input_names)
        self.state.mask.commit(len(held))  # what the request holds from its last stream
        reuse = _keep_prefix(self.state, reuse)
        self.chunk = chunk
        self.cached = reuse  # of them, taken over from an earlier request (prompt caching)
        self.fed: list[int] = list(held[:reuse])  # the ids in the KV state, in order
        self._release = release

    @property
    def req(self) -> Any:
        """The InferRequest (None once closed)."""
        return self.state.request if self.state is not None else None

    def _run(self, ids: np.ndarray) -> np.ndarray:
        n = ids.shape[1]  # ids: [1, n] int64
        inputs = {"input_ids": ids}
        if LOGITS_TO_KEEP in self.state.names:
            inputs[LOGITS_TO_KEEP] = _LAST_ONLY
        self.state.infer(inputs, n)
        self.fed.extend(int(t) for t in ids[0])
        logits = self.state.request.get_tensor("logits").data  # [1, n or 1, vocab]
        return np.array(logits[0, -1], dtype=np.float32)  # [vocab], a copy

    @property
    def past(self) -> int:
        """Tokens in the KV state."""
        return len(self.fed)

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
        state, self.state = self.state, None
        if state is not None and self._release is not None:
            self._release(state.request, self.fed)


def _keep_prefix(state: StatefulStream, reuse: int) -> int:
    """Keep the first `reuse` positions of the state (0: reset it). Returns how many were
    kept: a state that cannot be trimmed is reset instead."""
    try:
        state.keep_first(reuse)
    except Exception:  # e.g. a bf16 state numpy cannot hold: no reuse, still correct
        log.debug("prompt cache: trimming the KV state failed; prefilling in full", exc_info=True)
        state.reset()
        return 0
    return max(0, reuse)


_LAST_ONLY = np.ones(1, dtype=np.int64)  # logits_to_keep = [1]
_EVERY = np.zeros(1, dtype=np.int64)  # logits_to_keep = [0]


class AllLogitsCompiled:
    """The compiled model as code outside this module sees it: its requests start with
    logits_to_keep = [0] (every position, the model's unsliced behaviour), so streams that
    feed only the original inputs (speculative verify steps, draft models) get what they did."""

    def __init__(self, compiled) -> None:
        self._compiled = compiled

    def create_infer_request(self):
        import openvino as ov

        req = self._compiled.create_infer_request()
        req.set_tensor(LOGITS_TO_KEEP, ov.Tensor(_EVERY.copy()))
        return req

    def __getattr__(self, name: str):  # inputs, outputs, output(), get_property(), ...
        return getattr(self._compiled, name)


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
        cfg = compile_config(self.device, config.precision, self.cache_dir)
        self.model_dir = ensure_ir(Path(source), root, report, config.weights)
        report(f"compiling for {self.device}", 0.7)
        try:
            # read_model maps the .bin (ENABLE_MMAP, OpenVINO's default): constants point into
            # the file, the plugin makes the one copy it runs from.
            model = core.read_model(str(self.model_dir / IR_NAME))
            self.logits_to_keep = add_logits_to_keep(model)
            compiled = core.compile_model(model, self.device, cfg)
            del model
        except Exception as e:
            raise BackendError(f"compiling {self.model_dir.name} for {self.device} failed: {e}") from e
        self._compiled = compiled
        self.compiled = AllLogitsCompiled(compiled) if self.logits_to_keep else compiled
        self.input_names = {n for i in compiled.inputs for n in i.get_names()}
        if "input_ids" not in self.input_names or "logits" not in {
                n for o in compiled.outputs for n in o.get_names()}:
            raise BackendError(f"{self.model_dir} is not a causal-LM IR (needs input_ids -> logits)")
        self.chunk = config.prefill_chunk
        self.pool_size = config.idle_requests
        self._idle: KeptStates[Any] = KeptStates()  # InferRequests of closed streams, reused by new ones
        self._lock = threading.Lock()
        report("model ready", 1.0)

    def new_stream(self, prompt_ids: Sequence[int] = ()) -> OVStream:
        """A stream on an idle InferRequest when there is one: a fresh request re-grows its
        buffers token by token, measured 3-5x slower at first. Prompt caching: the idle
        request whose KV state shares the longest prefix with prompt_ids keeps that
        prefix (engine/runtime/prompt_cache.py); otherwise an idle request is reset."""
        with self._lock:
            found = self._idle.take(prompt_ids)
            if found is not None:
                req, held, reuse = found
            elif self._idle:
                (req, held), reuse = self._idle.pop(newest=True), 0  # the newest idle request, reset
            else:
                req, held, reuse = None, [], 0
        return OVStream(self._compiled, self.input_names, self.chunk, req, self._give_back, reuse, held)

    def set_prompt_cache(self, requests: int) -> None:
        """Keep at most this many idle requests (and their KV) from now on; 0 keeps none."""
        with self._lock:
            self.pool_size = max(0, int(requests))
            self._idle.drop(len(self._idle) - self.pool_size)

    def _give_back(self, req: Any, fed: list[int]) -> None:
        """Keep a finished stream's request, and what its KV state holds, for later
        streams; the oldest goes when the pool is full (pool_size bounds the memory)."""
        with self._lock:
            if self._compiled is not None and self.pool_size > 0:
                self._idle.keep(req, fed)
                self._idle.drop(len(self._idle) - self.pool_size)

    def close(self) -> None:
        with self._lock:
            self._idle.drop(len(self._idle))
            self.compiled = None
            self._compiled = None
