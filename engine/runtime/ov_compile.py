"""How a model is compiled on each device: one function for every process that loads one.

Measured on this machine's CPU (AVX2, 0.90 B random Llama, bf16 IR of 1.8 GB,
one fresh process per variant, compile + one 16-token inference):

    compile straight from the IR            0.5 s compile, 2.9 s to the first result, 1.70 GB anonymous
    import from a CACHE_DIR blob            0.1 s,          6.6 s,                      3.33 GB anonymous
    CACHE_MODE=OPTIMIZE_SIZE (weightless)   0.1 s,          3.9 s,                      3.33 GB anonymous
    ENABLE_MMAP off                         3.6 s,         12.1 s,                      3.46 GB anonymous

On CPU the plugin repacks the weights at the first inference whatever the
source, so a blob only adds a second copy: CPU compiles straight from the
IR, whose .bin OpenVINO maps (ENABLE_MMAP, its default, left on: the mapped
pages are clean file pages the kernel can drop, not anonymous memory).
GPU and NPU compile kernels / run a compiler for many seconds, so a cache
pays off there; GPU gets a weightless blob (CACHE_MODE=OPTIMIZE_SIZE: the
weights come from the mapped IR, not a second copy on disk and in RAM).
Virtual devices (AUTO, MULTI, HETERO, BATCH) may land on a GPU: cached too,
unless every device they name is a CPU.

Thread pinning: CPU gets ENABLE_CPU_PINNING off. With it on (the plugin's
Linux default in latency mode) every synchronous infer() moves the calling
thread onto the plugin's cores with sched_setaffinity, and moves it back:
py-spy put 30 % of a decode loop's samples in that syscall. Measured on this
machine (2 cores, other processes running, one process, interleaved):
a 2-layer model 3.9 -> 0.9 ms per decode step; the 0.90 B Llama 3.0 -> 4.2
tok/s and warm TTFT 2.7 -> 2.3 s (openvino_genai on the same IR: 3.8 tok/s,
3.0 s). The OS scheduler keeps the threads where they run anyway; a desktop
that runs other programs is exactly the loaded case.

One thread in bf16: OpenVINO 2026.4.1's CPU plugin dies with SIGFPE (a divide error inside
libopenvino_intel_cpu_plugin.so, at the first inference) running a Llama IR or shard in
bf16 on one thread -- INFERENCE_NUM_THREADS=1, or a process allowed one CPU (taskset) --
on a Xeon with AMX (seen 2026-12-05: the demo IR and every pipeline shard; f32 and f16 run;
two threads run; a lone MatMul, MLP or SDPA does not reproduce it). A CPU compile that
would run on one thread at the plugin's bf16 default therefore computes in f32
(single_thread_precision); an explicit "bf16" on one thread is refused with its reason.
An AMD EPYC with AVX-512-bf16 and no AMX ran the same one-thread bf16 shards (the suite passed
there): a CPU known to lack AMX keeps bf16.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

PRECISIONS = ("default", "f32", "f16", "bf16")
VIRTUAL_DEVICES = ("AUTO", "MULTI", "HETERO", "BATCH")
KV_PRECISION_DEVICES = ("CPU", "GPU")  # plugins that take KV_CACHE_PRECISION
WEIGHTLESS_CACHE_DEVICES = ("GPU",)  # plugins whose blob can leave the weights in the IR
UNPINNED_DEVICES = ("CPU",)  # plugins whose threads are not pinned to cores (see the module doc)


class CompileConfigError(ValueError):
    """A precision name the runtime does not know (code: unknown-precision)."""

    code = "unknown-precision"


def _physical(device: str) -> list[str]:
    """Base names of the physical devices a device string ends up on: "GPU.1" -> ["GPU"],
    "HETERO:GPU,CPU" -> ["GPU", "CPU"], "AUTO" -> [] (unknown until it runs)."""
    dev = device.strip().upper()
    head, _, tail = dev.partition(":")
    if head in VIRTUAL_DEVICES:
        return [d.strip().split(".")[0] for d in tail.split(",") if d.strip()]
    return [head.split(".")[0]]


def _plain(device: str) -> str | None:
    """The base name of a physical device ("GPU.1" -> "GPU"); None for a virtual one."""
    head = device.strip().upper().partition(":")[0]
    return None if head in VIRTUAL_DEVICES else head.split(".")[0]


def wants_blob_cache(device: str) -> bool:
    """True where compiling is slow enough for a CACHE_DIR blob to pay off (not on CPU)."""
    devices = _physical(device)
    return not devices or any(d != "CPU" for d in devices)


def compile_config(device: str, precision: str = "default", cache_dir: Path | None = None,
                   threads: int | None = None) -> dict[str, Any]:
    """The compile_model properties for `device`.

    precision: "default" leaves the plugin's choice; "f32" forces f32 math and,
    where the plugin has one, an f32 KV cache (bit-comparable with torch f32);
    "f16"/"bf16" force that inference precision. cache_dir is used only where
    wants_blob_cache(device). threads sets INFERENCE_NUM_THREADS (None = plugin's).
    A plain CPU gets ENABLE_CPU_PINNING off (the module doc has why).
    """
    if precision not in PRECISIONS:
        raise CompileConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    cfg: dict[str, Any] = {}
    if _plain(device) in UNPINNED_DEVICES:
        cfg["ENABLE_CPU_PINNING"] = False
    if precision != "default":
        cfg["INFERENCE_PRECISION_HINT"] = precision
        if precision == "f32" and _plain(device) in KV_PRECISION_DEVICES:
            cfg["KV_CACHE_PRECISION"] = "f32"
    if cache_dir is not None and wants_blob_cache(device):
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cfg["CACHE_DIR"] = str(cache_dir)
        if _plain(device) in WEIGHTLESS_CACHE_DEVICES:
            cfg["CACHE_MODE"] = "OPTIMIZE_SIZE"
    if threads:
        cfg["INFERENCE_NUM_THREADS"] = int(threads)
    if _plain(device) == "CPU":
        effective = single_thread_precision(precision, threads or allowed_cpus(), cpu_capabilities, cpu_has_amx)
        if effective != precision:
            log.warning("one CPU thread at bf16 crashes OpenVINO 2026.4's CPU plugin: computing in %s", effective)
            cfg["INFERENCE_PRECISION_HINT"] = effective
    return cfg


def allowed_cpus() -> int:
    """How many CPUs this process may run on (its affinity where the OS has one)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)


def cpu_capabilities() -> Sequence[str]:
    """The CPU plugin's OPTIMIZATION_CAPABILITIES ("BF16" where its default math is bf16)."""
    import openvino as ov

    return tuple(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def cpu_has_amx() -> bool | None:
    """Whether the CPU has AMX (Linux: the amx_bf16 flag of /proc/cpuinfo); None where the OS
    does not say, which single_thread_precision treats as "it may"."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    flags = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return None if flags is None else "amx_bf16" in flags.split()


def single_thread_precision(precision: str, threads: int, capabilities: Any = cpu_capabilities,
                            amx: Any = cpu_has_amx) -> str:
    """The precision a CPU compile may use on `threads` threads: `precision`, except that one
    thread never computes in bf16 on a CPU that has AMX, or may (see the module doc): the
    plugin's bf16 default becomes "f32", an explicit "bf16" is a CompileConfigError.
    capabilities: the plugin's OPTIMIZATION_CAPABILITIES; amx: cpu_has_amx()'s answer; each a
    value or a function returning it (asked only when it matters)."""
    if threads != 1 or precision not in ("default", "bf16"):
        return precision
    if (amx() if callable(amx) else amx) is False:  # AVX-512-bf16 without AMX runs it
        return precision
    if precision == "bf16":
        raise CompileConfigError("bf16 on one CPU thread crashes OpenVINO 2026.4's CPU plugin on AMX CPUs: "
                                 "use f32 or more threads")
    caps = capabilities() if callable(capabilities) else capabilities
    return "f32" if "BF16" in caps else precision
