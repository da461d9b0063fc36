"""`flotilla models list|pull|inspect|build-demos`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from engine.cli.progress import TerminalProgress


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list, download, inspect models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    ls = msub.add_parser("list", help="models on this PC (demo models, HF cache, added folders)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)
    pull = msub.add_parser("pull", help="download a hub id (or build a demo model) into the local cache")
    pull.add_argument("model", help="hub id like Qwen/Qwen3-0.6B, or a demo id like demo")
    pull.set_defaults(func=cmd_pull)
    ins = msub.add_parser("inspect", help="architecture, layers, bytes per layer, experts, KV bytes per token")
    ins.add_argument("model", help="demo id, hub id, HF folder or OpenVINO IR folder")
    ins.add_argument("--json", action="store_true", help="print the full ModelProfile as JSON")
    ins.set_defaults(func=cmd_inspect)
    add = msub.add_parser("add", help="remember a local model folder so it is listed")
    add.add_argument("path", help="a Hugging Face or OpenVINO IR folder")
    add.set_defaults(func=cmd_add)
    demos = msub.add_parser("build-demos", help="build every bundled demo model if missing (seconds)")
    demos.set_defaults(func=cmd_build_demos)


def cmd_list(args: argparse.Namespace) -> int:
    from engine.models import list_local_models

    entries = list_local_models()
    if args.json:
        print(json.dumps([_entry_dict(e) for e in entries], indent=2))
        return 0
    print(f"{'MODEL':34} {'KIND':9} {'ARCHITECTURE':26} {'SIZE':>9}")
    for e in entries:
        size = _human_bytes(e.size_bytes) if e.size_bytes else "-"
        arch = e.architecture or "-"
        note = "" if getattr(e, "built", True) else "  (built on first use)"
        print(f"{e.model_id:34} {e.kind:9} {arch:26} {size:>9}{note}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from engine.models import resolve_model

    progress = TerminalProgress()
    try:
        resolved = resolve_model(args.model, progress=progress)
    finally:
        progress.close()
    print(f"{resolved.model_id} ready at {resolved.path}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.models import profile_model, resolve_model

    progress = TerminalProgress()
    try:
        prof = profile_model(resolve_model(args.model, progress=progress))
    finally:
        progress.close()
    if args.json:
        print(json.dumps(prof.to_dict(), indent=2))
        return 0
    rows = [
        ("model", prof.model_id),
        ("architecture", f"{prof.architecture} ({prof.model_type})"),
        ("layers", prof.num_layers),
        ("hidden size", prof.hidden_size),
        ("heads / KV heads", f"{prof.num_heads} / {prof.num_kv_heads} (head dim {prof.head_dim})"),
        ("vocabulary", prof.vocab_size),
        ("total weights", _human_bytes(prof.total_bytes)),
        ("per layer", _human_bytes(max(prof.bytes_per_layer) if prof.bytes_per_layer else 0)),
        ("embeddings / head", f"{_human_bytes(prof.embedding_bytes)} / {_human_bytes(prof.head_bytes)}"),
        ("KV per token", _human_bytes(prof.kv_bytes_per_token)),
        ("max context", prof.max_context),
    ]
    if prof.experts is not None:
        ex = prof.experts
        rows.append(("experts", f"{ex.num_experts} per layer, top-{ex.top_k}, "
                                f"{_human_bytes(ex.bytes_per_expert)} each"))
    for key, value in rows:
        print(f"{key:18} {value}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    from engine.models import add_model_folder

    entry = add_model_folder(args.path)
    print(f"added {entry.model_id} ({entry.path})")
    return 0


def cmd_build_demos(args: argparse.Namespace) -> int:
    from engine.models.demo import demo_ids, demo_path, ensure_demo

    for demo_id in demo_ids():
        if (demo_path(demo_id) / "config.json").exists():
            continue
        progress = TerminalProgress()
        try:
            ensure_demo(demo_id, progress=progress)
        finally:
            progress.close()
    print("demo models ready: " + ", ".join(demo_ids()))
    return 0


def _entry_dict(e) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(e).items()}


def _human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
