"""Where a benchmark figure came from: the code, the machine and its load.

Every JSON that `flotilla bench` writes carries this block, so a figure quoted
in the README or docs/ can be traced to the commit that produced it, the CPU it
ran on (model, the ISA flags that change OpenVINO's kernels and default
precision) and how busy the machine was. `flotilla bench report` refuses a JSON
without it.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# CPU flags that decide which kernels OpenVINO picks and its default precision
# (bf16/AMX machines default to bf16 math; AVX2-only ones to f32).
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
                  "amx_bf16", "amx_int8", "amx_tile")


# What a run measures: a change elsewhere (docs/, tests/, a Markdown file) does not
# make its figures those of another code.
CODE_PATHS = ("engine/", "app/", "assets/", "pyproject.toml")


@functools.lru_cache(maxsize=None)
def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """HEAD's hash, and the code files that differed from it (a dirty run is not the commit).
    Read once per process: every run of `flotilla bench --runs N` executes the code the
    process loaded at its start, whatever is committed meanwhile."""
    def git(*argv: str) -> str:
        res = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, timeout=10)
        if res.returncode != 0:
            raise RuntimeError(res.stderr.strip() or "git failed")
        return res.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:].strip() for line in git("status", "--porcelain", "--untracked-files=all").splitlines()]
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None, "dirty_paths": None}
    dirty = sorted(p for p in changed if p.startswith(CODE_PATHS) and "/_figures/" not in p)
    return {"commit": commit, "dirty": bool(dirty), "dirty_paths": dirty}


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """Model name, core count and the relevant ISA flags of this machine."""
    text = cpuinfo
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags":
            flags = set(value.split())
    return {
        "model": model,
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": sorted(f for f in RELEVANT_FLAGS if f in flags),
        "openvino_cpu": _openvino_cpu(),
    }


def _openvino_cpu() -> dict[str, Any] | None:
    """What OpenVINO's CPU plugin says it can do (FP32-only means f32 is the default precision)."""
    try:
        import openvino as ov

        core = ov.Core()
        caps = list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
        hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")  # an ov.Type: "bf16", "f32", "f16"
        hint = getattr(hint, "type_name", None) or str(hint)
        return {"version": ov.get_version(), "capabilities": caps, "default_precision": hint}
    except Exception:  # noqa: BLE001 - provenance must never fail a benchmark
        return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def memory_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def collect_before() -> dict[str, Any]:
    """The block written at the start of a run; `finish` adds the load after it."""
    return {
        **dict(git_commit()),
        "python": platform.python_version(),
        "cpu": cpu_info(),
        "memory_bytes": memory_total_bytes(),
        "load_before": load_average(),
        "ci": bool(os.environ.get("CI")),
    }


def finish(block: dict[str, Any]) -> dict[str, Any]:
    return {**block, "load_after": load_average()}


REQUIRED = ("commit", "dirty", "cpu", "load_before", "load_after")


def missing_fields(block: Any) -> list[str]:
    """Which provenance fields a bench JSON lacks (empty: it can be quoted)."""
    if not isinstance(block, dict):
        return list(REQUIRED)
    out = [k for k in REQUIRED if block.get(k) is None]
    cpu = block.get("cpu")
    if not isinstance(cpu, dict) or not cpu.get("model") or "flags" not in cpu or not cpu.get("cores"):
        out.append("cpu.model/flags/cores")
    return out
