"""`flotilla bench codec`: what the wire codec costs per message, in µs and bytes.

A fixed set of representative messages (MESSAGES): the pipeline's StageStep and
StageResult, sent for every generated token (a plain decode step and a speculative
one that hides rejected drafts); a GenerateRequest, plain and with tools and tool
calls; a streamed TokenEvent and a final one; the fleet control plane (a status
request and its nested reply, a load request, a 64 KiB shard chunk, an agent event)
and a refused ErrorReply. Each goes through the public API only
(engine.protocol.encode / decode, and encode_frames / decode_frames for the two
framed data-plane hops of FRAMED), so the same scenario measures any codec behind it.

Per message, over --repeats repeats of --iterations calls each (the garbage
collector off while timing, as timeit does): the median and min-max µs of one
encode + decode round trip, of encode and of decode alone, and of building the
message from its fields (the class's own checks, paid wherever one is made); and
its encoded bytes. `per_token_us` adds the round trips of the two messages a
pipeline sends for every token (pipeline_step, pipeline_result).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import statistics
import time
from collections.abc import Callable
from typing import Any

NAME = "codec"
HELP = "the wire codec: µs per encode+decode round trip and encoded bytes of representative messages"

SHA = "ab" * 32
NODE = "0123456789abcdef0123456789abcdef"
Z85 = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
STREAM = "stream-7f3a9c2e"
HIDDEN = 1024  # hidden size of the framed step's activation row
VOCAB = 32_000  # logits row of the framed result
PER_TOKEN = ("pipeline_step", "pipeline_result")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per figure (default 15; quick 5)")
    p.add_argument("--iterations", type=int, default=None,
                   help="calls per repeat (default 2000; quick 200)")


def _agent_info() -> Any:
    from engine.protocol.control import AgentInfo, DeviceInfo

    return AgentInfo(node_id=NODE, hostname="office-pc-3", os="Linux 6.8", version="0.1.0", protocol=6,
                     devices=(DeviceInfo("CPU", "Intel(R) Core(TM) Ultra 7 155H"),
                              DeviceInfo("GPU.0", "Intel(R) Arc(TM) Graphics")),
                     ram_total=32 * 2**30, ram_available=21 * 2**30, idle=True, idle_since=1_767_000_000.5,
                     on_ac=True, control_port=47601, pair_port=47602, info_port=47603, public_key=Z85,
                     fingerprint="0123456789abcdef")


def _tool_request() -> Any:
    from engine.protocol import (
        ChatMessage,
        GenerateRequest,
        SamplingParams,
        ToolCall,
        ToolSpec,
    )

    weather = ToolSpec("get_weather", "The weather in a city, now.",
                       '{"type": "object", "properties": {"city": {"type": "string"}, '
                       '"unit": {"enum": ["c", "f"]}}, "required": ["city"]}')
    clock = ToolSpec("get_time", "The local time in a city.",
                     '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}')
    turns = (ChatMessage("system", "You are a helpful assistant. Use the tools when they help."),
             ChatMessage("user", "What is the weather in Lyon, and what time is it there?"),
             ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Lyon"}'),
                                                      ToolCall("call_2", "get_time", '{"city": "Lyon"}'))),
             ChatMessage("tool", '{"temp": 14, "sky": "cloudy"}', tool_call_id="call_1"),
             ChatMessage("tool", '{"time": "16:05"}', tool_call_id="call_2"))
    return GenerateRequest("chatcmpl-7f3a9c2e4b", messages=turns, tools=(weather, clock),
                           sampling=SamplingParams(max_tokens=512, temperature=0.7, top_p=0.95, seed=7))


def messages() -> dict[str, Callable[[], Any]]:
    """Name -> a function building the message (so building can be timed too)."""
    from engine.protocol import (
        ChatMessage,
        ErrorReply,
        GenerateRequest,
        Refusal,
        SamplingParams,
        Timings,
        TokenEvent,
        Usage,
    )
    from engine.protocol.control import (
        AgentEvent,
        ChunkRequest,
        LoadRequest,
        ShardInfo,
        StatusReply,
        StatusRequest,
    )
    from engine.protocol.pipeline import StageResult, StageStep

    info = _agent_info()
    shards = tuple(ShardInfo(f"llama-3.1-8b/L{i * 8}-{i * 8 + 8}", SHA, 1_900_000_000, 1_900_000_000,
                             "running" if i == 0 else "cached", 4242 if i == 0 else None, None,
                             "CPU" if i == 0 else None) for i in range(3))
    chunk = bytes(range(256)) * 256  # 64 KiB
    return {
        "pipeline_step": lambda: StageStep(STREAM, 41, 57, reset=False, want_token=True, want_logits=True,
                                           stage_ms=(1.25,)),
        "pipeline_step_spec": lambda: StageStep(STREAM, 42, 62, reset=False, want_token=True, want_logits=True,
                                                stage_ms=(1.25,), position=58, hide=(58, 62), want_all=True),
        "pipeline_result": lambda: StageResult(STREAM, 41, 1234, (1.25, 0.75)),
        "generate_request": lambda: GenerateRequest(
            "chatcmpl-7f3a9c2e4b", messages=(ChatMessage("system", "You are a helpful assistant."),
                                             ChatMessage("user", "Tell me a story about a robot by the sea.")),
            sampling=SamplingParams(max_tokens=256, temperature=0.8, top_p=0.95, stop=("\n\n",))),
        "generate_request_tools": _tool_request,
        "token_event": lambda: TokenEvent("chatcmpl-7f3a9c2e4b", text=" robot", token_ids=(17_312,)),
        "token_event_final": lambda: TokenEvent("chatcmpl-7f3a9c2e4b", text=".", token_ids=(13,), finish_reason="stop",
                                                usage=Usage(42, 256, 32), timings=Timings(0.001, 0.08, 2.6, 101.5)),
        "error_reply_refused": lambda: ErrorReply("load-7", "refused", "needs 3.10 GB but the RAM cap leaves 2.00 GB",
                                                  Refusal("policy_cap", 3_100_000_000, 2_000_000_000)),
        "status_request": lambda: StatusRequest("status-7f3a9c2e"),
        "status_reply": lambda: StatusReply("status-7f3a9c2e", info, True, "", shards),
        "load_request": lambda: LoadRequest("load-7f3a9c2e", SHA, "CPU", 0, ring_keys=(Z85, Z85),
                                            context_length=4096, streams=4),
        "chunk_request_64k": lambda: ChunkRequest("chunk-7f3a9c2e", SHA, 1 << 20, chunk, SHA),
        "agent_event": lambda: AgentEvent(NODE, "yielding", "user returned", (SHA,), 1_767_000_000.25),
    }


def framed() -> dict[str, Callable[[], tuple[Any, list[Any]]]]:
    """Name -> (message, tensors) of a data-plane hop as the pipeline sends it for every token."""
    import numpy as np

    from engine.protocol.pipeline import StageResult, StageStep

    hidden = np.linspace(-1.0, 1.0, HIDDEN, dtype=np.float32).reshape(1, 1, HIDDEN)
    logits = np.linspace(-5.0, 5.0, VOCAB, dtype=np.float32)
    return {
        "pipeline_step_hidden": lambda: (StageStep(STREAM, 41, 57, reset=False, want_token=True, want_logits=True,
                                                   stage_ms=(1.25,)), [hidden]),
        "pipeline_result_logits": lambda: (StageResult(STREAM, 41, 1234, (1.25, 0.75)), [logits]),
    }


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def _time(fn: Callable[[], Any], repeats: int, iterations: int) -> dict[str, float]:
    """µs per call of fn: median and min-max over repeats of `iterations` calls (gc off, as timeit),
    after a tenth of them untimed (warm caches, first-call work)."""
    for _ in range(iterations // 10 + 1):
        fn()
    per: list[float] = []
    for _ in range(repeats):
        was = gc.isenabled()
        gc.disable()
        try:
            t = time.perf_counter()
            for _ in range(iterations):
                fn()
            per.append((time.perf_counter() - t) * 1e6 / iterations)
        finally:
            if was:
                gc.enable()
    return _spread(per)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.protocol import (
        PROTOCOL_VERSION,
        decode,
        decode_frames,
        encode,
        encode_frames,
    )

    repeats = max(1, args.repeats or (5 if args.quick else 15))
    iterations = max(1, args.iterations or (200 if args.quick else 2000))
    out: dict[str, Any] = {}
    for name, make in messages().items():
        msg = make()
        data = encode(msg)
        if decode(data) != msg:
            raise AssertionError(f"{name}: the decoded message differs from the one encoded")
        row = {"kind": msg.KIND, "bytes": len(data),
               "roundtrip_us": _time(lambda m=msg: decode(encode(m)), repeats, iterations),
               "encode_us": _time(lambda m=msg: encode(m), repeats, iterations),
               "decode_us": _time(lambda d=data: decode(d), repeats, iterations),
               "construct_us": _time(make, repeats, iterations)}
        report(f"{name}: {row['bytes']} B, round trip {row['roundtrip_us']['median']} µs")
        out[name] = row
    frames_out: dict[str, Any] = {}
    for name, make in framed().items():
        msg, tensors = make()
        frames = [bytes(f) for f in encode_frames(msg, tensors)]
        back, arrays = decode_frames(frames)
        if back != msg or len(arrays) != len(tensors):
            raise AssertionError(f"{name}: the decoded frames differ from the ones encoded")
        row = {"kind": msg.KIND, "frames": len(frames), "header_bytes": len(frames[0]),
               "tensor_bytes": sum(len(f) for f in frames[1:]),
               "roundtrip_us": _time(lambda m=msg, t=tensors: decode_frames(encode_frames(m, t)), repeats, iterations),
               "encode_us": _time(lambda m=msg, t=tensors: encode_frames(m, t), repeats, iterations),
               "decode_us": _time(lambda f=frames: decode_frames(f), repeats, iterations)}
        report(f"{name}: header {row['header_bytes']} B, round trip {row['roundtrip_us']['median']} µs")
        frames_out[name] = row
    return {
        "codec": {"protocol_version": PROTOCOL_VERSION, "msgpack": _version("msgpack"),
                  "msgspec": _version("msgspec")},
        "settings": {"repeats": repeats, "iterations": iterations},
        "messages": out,
        "frames": frames_out,
        "per_token_us": round(sum(out[n]["roundtrip_us"]["median"] for n in PER_TOKEN), 3),
        "per_token_messages": list(PER_TOKEN),
    }
