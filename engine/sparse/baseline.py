"""The OS-paging baseline: the dense model through mmap under a cgroup memory cap
(what llama.cpp + mmap does when a model is bigger than the RAM it may use).

The child process is placed in a fresh cgroup-v1 memory group before it
imports anything, so all its memory (anonymous and page cache) is charged
there. It builds the model the way the sparse engine does -- attention, norms
and embeddings resident, in the same dtypes and kernels -- but with every FFN
matrix a view of the mmap'd checkpoint (same dtype as the engine's bundles:
a bf16 checkpoint is read as bf16 by both), drops the file from the page
cache (posix_fadvise DONTNEED: a cold start), reports its own usage, and
waits; the parent sets the limit to that usage + slack + the FFN byte cap
(the same bytes the engine gets for gates, predictors and neuron cache) and
lets it run with the kernel's default readahead. Under the limit the kernel
evicts weight pages and faults them in again on every token that needs them.
Bytes read come from /proc/self/io (read_bytes: what reached the disk).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

CGROOT = Path("/sys/fs/cgroup/memory")


def cgroups_available() -> bool:
    return (CGROOT / "cgroup.procs").exists() and os.access(CGROOT, os.W_OK)


def drop_page_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_capped_child(argv: list[str], weight_cap_bytes: int, slack_bytes: int = 16 * 2**20,
                     timeout: float = 900, what: str = "child", limit_bytes: int | None = None) -> dict:
    """Run `python -m <argv>` in a fresh memory group; once it prints READY (set up: resident
    weights loaded, page cache dropped), cap the group at its usage + slack + weight_cap_bytes,
    send GO and return the JSON of its last line, with the limit and peak. The sparse engine
    and the mmap baseline both run this way, so they get the same allowance above their
    common setup (attention, embeddings, the interpreter).

    limit_bytes: the group is capped there from the child's first byte instead (set-up
    included: what a PC with that much memory gives the process); weight_cap_bytes and
    slack_bytes are then unused. A child may print {"error": ...} as its last line to
    report a refusal (a budget that does not fit): it is returned as it is."""
    group = CGROOT / f"flotilla-sparse-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        procs = str(group / "cgroup.procs")
        if limit_bytes is not None:
            (group / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))

        def enter() -> None:  # in the child, before exec: charge everything to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]) + os.pathsep
                   + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        child = subprocess.Popen([sys.executable, "-m", *argv], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, preexec_fn=enter, env=env)
        try:
            first = child.stdout.readline()
            ready = first.split()
            usage = int((group / "memory.usage_in_bytes").read_text())
            if ready and ready[0] == "READY":
                limit = int(limit_bytes) if limit_bytes is not None else usage + slack_bytes + weight_cap_bytes
                if limit_bytes is None:
                    (group / "memory.limit_in_bytes").write_text(str(limit))
                child.stdin.write("GO\n")
                child.stdin.flush()
                out, _ = child.communicate(timeout=timeout)
            elif first.startswith("{"):  # refused during set-up: its one-line reason
                child.communicate(timeout=timeout)
                return json.loads(first)
            else:
                child.wait(timeout=timeout)
                killed = _oom_kills(group) > 0
                raise RuntimeError(f"{what} " + (f"OOM-killed while setting up under a {limit_bytes / 1e6:.0f} MB "
                                                 "limit" if killed else f"failed to start (exit {child.returncode}, "
                                                 f"printed {first.strip()[:200]!r})"))
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        kills = _oom_kills(group)
        if child.returncode != 0:
            why = "OOM-killed under the cap" if kills else f"exited with {child.returncode}"
            raise RuntimeError(f"{what} {why}")
        result = json.loads(out.strip().splitlines()[-1])
        result.update(cgroup_limit_bytes=limit, setup_usage_bytes=usage,
                      max_usage_bytes=int((group / "memory.max_usage_in_bytes").read_text()),
                      oom_kills=kills)
        return result
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _oom_kills(group: Path) -> int:
    """Processes of the group the OOM killer ended (memory.oom_control's oom_kill)."""
    for line in (group / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value or 0)
    return 0


def run_mmap_baseline(model_dir: Path, prompt: list[int], tokens: int, weight_cap_bytes: int,
                      slack_bytes: int = 16 * 2**20, timeout: float = 900, limit_bytes: int | None = None,
                      kv_precision: str = "f16") -> dict:
    """The dense model through mmap under a cap of (its setup usage + slack + weight_cap_bytes):
    weight_cap_bytes is the page cache the FFN weights may use (the engine's cap); or under
    limit_bytes from its first byte. Its keys and values are kept at `kv_precision`, as the
    sparse engine it is compared with keeps them."""
    return run_capped_child(["engine.sparse.baseline", str(model_dir), json.dumps(prompt), str(tokens), kv_precision],
                            weight_cap_bytes, slack_bytes, timeout, what="mmap baseline child",
                            limit_bytes=limit_bytes)


def _child(model_dir: str, prompt: str, tokens: str, kv_precision: str) -> None:
    import torch

    from engine.runtime.torch_backend import TorchStream
    from engine.runtime.torch_kv import KV_DTYPES
    from engine.sparse.weights import load_dense_mmap, safetensors_files

    torch.set_grad_enabled(False)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = load_dense_mmap(Path(model_dir))
    drop_page_cache(safetensors_files(Path(model_dir)))
    print("READY", flush=True)
    sys.stdin.readline()
    ids, n = json.loads(prompt), int(tokens)
    stream = TorchStream(model, kv_dtype=KV_DTYPES[kv_precision])
    t0 = time.perf_counter()
    logits = stream.prefill(ids)
    t1 = time.perf_counter()
    io_prefill = _read_bytes()
    out, times = [], []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    print(json.dumps({"prefill_s": t1 - t0, "decode_s": times, "tokens": out,
                      "decode_read_bytes": _read_bytes() - io_prefill}), flush=True)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return int(io.get("read_bytes", 0))


if __name__ == "__main__":
    _child(*sys.argv[1:5])
