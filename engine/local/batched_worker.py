"""The batched engine's pipeline process: openvino_genai's ContinuousBatchingPipeline, stepped here.

Why a process of its own: the pipeline's Python binding holds the GIL for the whole of
step(), one batched forward pass (tens of ms at 1 B), so in the serving process every
other thread -- the HTTP server streaming answers, the app's window -- stood still for
each step. Measured at 0.9 B: a thread sleeping 1 ms at a time woke 31 times in the 1.35 s
of one 32-token answer beside the pipeline, 1348 times beside the local engine (whose
OpenVINO infer() releases the GIL). Here the pipeline has the interpreter to itself; the
serving process (engine/local/batched.py) keeps the tokenizer, the chat template and
generation.accept, and only ids cross the pipe.

Wire: msgpack maps, parent -> child on stdin, child -> parent on a private copy of stdout
(fd 1 itself is pointed at stderr, so a native library's print cannot corrupt the stream).
stdin closing -- the parent stopped us, or died -- ends the process.
  parent -> child  {"op": "add", "id", "ids", "config"}   config: GenerationConfig fields
                   {"op": "cancel", "id"}
  child -> parent  {"op": "ready"} or {"op": "failed", "error"}, once, after the compile;
                   then after every step {"op": "step", "out": [[id, token_ids, logprobs,
                   status, error], ...]} for the requests that made tokens or ended.
  status: one of STATUSES; a request is never reported again after a status other than
  "running".
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
from typing import Any, BinaryIO, Callable

import msgpack

from engine.protocol.errors import one_line

STATUSES = ("running", "finished", "ignored", "cancelled", "error")


# -- framing (both ends) ---------------------------------------------------------
def send(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(msgpack.packb(message, use_bin_type=True))
    out.flush()


def read_messages(fd: int, put: Callable[[dict[str, Any] | None], None]) -> None:
    """Read msgpack maps from fd until it ends, put() each, then put(None). os.read, not a
    buffered file: a thread blocked in a buffered read holds that file's lock, and a child
    forked meanwhile (OpenVINO's telemetry forks one) would inherit it held."""
    unpacker = msgpack.Unpacker(raw=False)
    try:
        while chunk := os.read(fd, 1 << 16):
            unpacker.feed(chunk)
            for message in unpacker:
                put(message)
    except OSError:
        pass
    finally:
        put(None)


# -- the child -------------------------------------------------------------------
def _why(e: BaseException) -> str:
    return one_line(e) or type(e).__name__


def scheduler_config(max_concurrent: int, kv_cache_gb: float, chunk: int) -> Any:
    import openvino_genai as ov_genai

    sc = ov_genai.SchedulerConfig()
    sc.cache_size = max(1, int(round(kv_cache_gb)))  # GB
    sc.max_num_seqs = max_concurrent
    sc.max_num_batched_tokens = chunk  # prompt tokens fused into one step with the others' decodes
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = True
    return sc


def generation_config(fields: dict[str, Any]) -> Any:
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    for name, value in fields.items():
        setattr(cfg, name, set(value) if name == "stop_token_ids" else value)
    return cfg


def _status(handle: Any) -> str:
    import openvino_genai as ov_genai

    s = handle.get_status()
    if s == ov_genai.GenerationStatus.RUNNING:
        return "running"
    if s == ov_genai.GenerationStatus.FINISHED:
        return "finished"
    if s == ov_genai.GenerationStatus.IGNORED:
        return "ignored"  # the paged KV cache cannot hold the request
    return "cancelled"  # CANCEL / STOP: ended by a cancel() we were asked for


def _read(handle: Any) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    lps: list[float] = []
    if handle.can_read():
        for out in handle.read().values():  # one sequence per request (no beams, n = 1)
            ids += [int(t) for t in out.generated_ids]
            lps += [float(x) for x in out.generated_log_probs]
    return ids, lps


def serve(pipe: Any, inbox: queue.SimpleQueue, out: BinaryIO) -> None:
    """The step loop: take what the parent sent, step while anything runs, report."""
    import numpy as np
    import openvino as ov

    handles: dict[int, Any] = {}
    while True:
        messages = [inbox.get()] if not handles else []  # idle: sleep until the parent writes
        while True:
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        rows: list[list[Any]] = []
        for m in messages:
            if m is None:
                return  # stdin closed
            if m["op"] == "add":
                try:
                    handles[m["id"]] = pipe.add_request(m["id"], ov.Tensor(np.array([m["ids"]], np.int64)),
                                                        generation_config(m["config"]))
                except Exception as e:  # a bad config: this request ends, the others go on
                    rows.append([m["id"], [], [], "error", _why(e)])
            elif m["op"] == "cancel" and m["id"] in handles:
                handles.pop(m["id"]).cancel()  # the pipeline frees it in its next step
        if handles:
            try:
                pipe.step()  # one batched forward: a token for every running request
            except Exception as e:
                rows += [[rid, [], [], "error", _why(e)] for rid in handles]
                handles.clear()
            for rid, handle in list(handles.items()):
                ids, lps = _read(handle)
                status = _status(handle)
                if status != "running":
                    del handles[rid]
                if ids or status != "running":
                    rows.append([rid, ids, lps, status, None])
        if rows or messages:  # every step is reported: the parent's turn ticks with it
            send(out, {"op": "step", "out": rows})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the batched engine's pipeline process (started by the engine)")
    p.add_argument("--folder", required=True, help="the IR's openvino_genai folder")
    p.add_argument("--device", default="CPU")
    p.add_argument("--precision", default="default")
    p.add_argument("--max-concurrent", type=int, default=8)
    p.add_argument("--kv-cache-gb", type=float, default=2)
    p.add_argument("--prefill-chunk", type=int, default=512)
    args = p.parse_args(argv)
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_messages, args=(0, inbox.put), name="batched-inbox", daemon=True).start()
    try:
        import openvino_genai as ov_genai

        from engine.runtime.ov_compile import compile_config

        pipe = ov_genai.ContinuousBatchingPipeline(
            args.folder, scheduler_config(args.max_concurrent, args.kv_cache_gb, args.prefill_chunk), args.device,
            compile_config(args.device, args.precision))
    except Exception as e:
        send(out, {"op": "failed", "error": _why(e)})
        return 1
    send(out, {"op": "ready"})
    try:
        serve(pipe, inbox, out)
    finally:
        del pipe
    return 0


if __name__ == "__main__":
    sys.exit(main())
