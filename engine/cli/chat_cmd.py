"""`flotilla chat`: one prompt with -p, or a REPL; streams and prints tok/s."""

from __future__ import annotations

import argparse
import sys
import uuid

from engine.platform.memory import settle_heap
from engine.cli.progress import TerminalProgress
from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams
from engine.runtime.ov_weights import WEIGHT_CHOICES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal")
    add_engine_arguments(p)
    p.add_argument("-p", "--prompt", help="answer this one prompt and exit (default: an interactive chat)")
    p.add_argument("--system", help="a system prompt")
    add_sampling_arguments(p)
    add_speculative_arguments(p)
    p.set_defaults(func=cmd_chat)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=("draft", "lookup", "off"), default="off",
                   help="speculative decoding: a small draft model, prompt lookup (n-grams), or off (default); "
                        "answers are the same, only faster (docs/speculative.md)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for --speculative draft: demo id or folder sharing the model's tokenizer "
                        "(default: the model's known draft, e.g. demo-draft for demo)")
    p.add_argument("--spec-k", type=int, default=4,
                   help="drafted tokens per step; adapted to the acceptance rate up to max(k, 8) (default 4)")
    p.add_argument("--spec-fixed-k", action="store_true", help="keep --spec-k fixed (no adaptation)")


def speculative_from_args(args: argparse.Namespace):
    """The engine's SpecConfig from the CLI (None when off and no draft model was named)."""
    from engine.cli.errors import UserError
    from engine.speculative.config import SpecConfig

    mode = getattr(args, "speculative", "off")
    if mode == "off" and not getattr(args, "draft_model", None):
        return None
    try:
        return SpecConfig(mode=mode, k=args.spec_k, adaptive=not args.spec_fixed_k,
                          draft_model=args.draft_model)
    except ValueError as e:
        raise UserError(f"--spec-k: {e}") from None


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    from engine.local.factory import ENGINE_KINDS

    p.add_argument("--model", "-m", default="demo",
                   help="demo id, local HF folder, OpenVINO IR folder or hub id (default: demo)")
    p.add_argument("--engine", choices=list(ENGINE_KINDS), default="local",
                   help="; ".join(f"{k}: {d}" for k, (_, d) in ENGINE_KINDS.items()) + " (default: local)")
    p.add_argument("--device", default="CPU", help="OpenVINO device: CPU, GPU, NPU or AUTO (default: CPU)")
    p.add_argument("--precision", choices=("default", "f32"), default="default",
                   help="f32 forces full-precision math and KV cache (exact, slower); "
                        "default lets the device choose (bf16/u8 KV on recent CPUs; moe/sparse: f16 KV)")
    p.add_argument("--backend", choices=("openvino", "torch"), default="openvino",
                   help="local engine: openvino (default) or the transformers reference path")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto",
                   help="local engine: weight precision of the OpenVINO export, made once per format and cached: "
                        "auto (default) = the checkpoint's own dtype (bf16 for a bf16 checkpoint), f32, bf16, fp16, "
                        "int8 (asymmetric, per channel) or int4 (symmetric, groups of 128); "
                        "moe engine: auto or int8 (symmetric, per row; experts and resident matrices)")
    p.add_argument("--cache-budget", type=_parse_bytes, default=None, metavar="SIZE",
                   help="moe/sparse engines: RAM for cached experts/neurons, e.g. 2GB or 512MB "
                        "(default: what is left once the resident weights and the KV reserve are in)")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="prompt + answer tokens per request (default: the model's, at most 4096); the moe "
                        "and sparse engines reserve KV for this many per request up front")
    p.add_argument("--max-concurrent", type=int, default=None, metavar="N",
                   help="requests computed at once: local/loop engines (default 8; the local engine runs them "
                        "in one forward pass), moe engine (default 4, each with its KV reserve)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed,
        stop=tuple(args.stop),
    )


def open_engine_from_args(args: argparse.Namespace):
    from engine.cli.errors import UserError
    from engine.local.factory import EngineOptions, open_engine

    spec = speculative_from_args(args)
    weights = getattr(args, "weights", "auto")
    extra: dict = {"speculative": spec} if spec is not None else {}
    if args.engine == "moe":
        if weights not in ("auto", "int8"):
            raise UserError(f"--weights {weights}: the moe engine keeps the checkpoint's dtype (auto) "
                            "or quantizes to int8")
        if weights == "int8":
            extra["weights"] = "int8"
        weights = "auto"
        for name in ("context", "max_concurrent"):
            value = getattr(args, name, None)
            if value is not None:
                if value < 1:
                    raise UserError(f"--{name.replace('_', '-')} must be at least 1")
                extra["context_length" if name == "context" else name] = value
    else:
        if getattr(args, "max_concurrent", None) is not None:
            if args.engine not in ("local", "loop"):
                raise UserError("--max-concurrent applies to the local, loop and moe engines")
            if args.max_concurrent < 1:
                raise UserError("--max-concurrent must be at least 1")
            extra["max_concurrent"] = args.max_concurrent
        if getattr(args, "context", None) is not None:
            if args.context < 1:
                raise UserError("--context must be at least 1")
            extra["context_length"] = args.context
    if weights != "auto" and (args.engine != "local" or args.backend != "openvino"):
        raise UserError("--weights applies to the local engine's OpenVINO backend and the moe engine "
                        "(pipeline shards: `flotilla pipeline --weights`)")
    options = EngineOptions(device=args.device, precision=args.precision, backend=args.backend,
                            cache_budget_bytes=args.cache_budget, extra=extra)
    progress = TerminalProgress()
    try:
        if weights != "auto":
            return _open_local_at(args.model, weights, options, progress)
        return open_engine(args.model, kind=args.engine, options=options, progress=progress)
    finally:
        progress.close()


def _open_local_at(model: str, weights: str, options, progress):
    """The local engine on the export of `model` at `weights` (exported first if missing).

    The export is made here, then the engine opens that IR folder under the model's own id
    (so its known draft model, its name in the chat header, ... stay the model's)."""
    from pathlib import Path

    from engine.cli.errors import UserError
    from engine.models import resolve_model
    from engine.runtime.errors import BackendError
    from engine.runtime.ov_backend import ensure_ir
    from engine.local.factory import open_whole_model

    resolved = resolve_model(model, progress)
    try:
        ir = ensure_ir(Path(resolved.path), progress=progress, weights=weights)
    except BackendError as e:
        raise UserError(str(e)) from None
    kw = {k: options.extra[k] for k in ("context_length", "speculative") if k in options.extra}
    return open_whole_model(ir, resolved.model_id, progress, device=options.device, precision=options.precision,
                            **kw)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _parse_bytes(text: str) -> int:
    """'2GB', '512 MiB', '1000000' -> bytes (argparse type)."""
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGIB")
    unit = raw[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GB or 512MB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive: {text!r}")
    return int(value)


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)  # validate before the (slow) engine start
    engine = open_engine_from_args(args)
    try:
        return chat_session(engine, args, sampling, f"on {engine.info.device}")
    finally:
        engine.close()


def chat_session(engine, args: argparse.Namespace, sampling: SamplingParams, where: str) -> int:
    """One answer with -p, else a REPL on stdin (shared by `chat` and `pipeline`)."""
    history: list[ChatMessage] = []
    if args.system:
        history.append(ChatMessage("system", args.system))
    if args.prompt is not None:
        _answer(engine, history, args.prompt, sampling)
        return 0
    settle_heap()  # a conversation follows: no full collection of the loaded libraries mid-answer
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {engine.info.model_id} {where}. "
              "/reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        _answer(engine, history, text, sampling)


def _answer(engine, history: list[ChatMessage], prompt: str, sampling: SamplingParams) -> None:
    """Stream one answer; on success both turns join the history."""
    history.append(ChatMessage("user", prompt))
    request = GenerateRequest(request_id=uuid.uuid4().hex, messages=tuple(history), sampling=sampling)
    request_id = engine.submit(request)
    pieces: list[str] = []
    final = None
    try:
        for event in engine.stream(request_id):
            if event.text:
                pieces.append(event.text)
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.final:
                final = event
    except KeyboardInterrupt:
        engine.cancel(request_id)
        history.pop()
        print("\n[stopped]", file=sys.stderr)
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if final is not None and final.finish_reason == "error":
        history.pop()
        from engine.core.interface import EngineError

        raise EngineError(final.error or "generation failed")
    history.append(ChatMessage("assistant", "".join(pieces)))
    if final is not None and final.usage is not None and final.timings is not None:
        t = final.timings
        print(f"[{final.usage.completion_tokens} tokens · {t.decode_tok_s:.1f} tok/s · "
              f"first token {t.ttft_s * 1000:.0f} ms · {final.finish_reason}]", file=sys.stderr)
