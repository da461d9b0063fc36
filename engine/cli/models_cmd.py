"""`flotilla models list|pull|inspect|add|build-demos|train-demos|eval-demos`."""

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
    train = msub.add_parser("train-demos", help="train the demo models on the Python stdlib + docs "
                                                "(minutes each, CPU; writes assets/demo/trained)")
    train.add_argument("--only", type=_id_list, default=None, metavar="ID,...",
                       help="demo ids to train (default: all five, one tokenizer)")
    train.add_argument("--steps", type=_positive, default=None, help="optimizer steps (default: per model)")
    train.add_argument("--out", type=Path, default=None, help="output folder (default: assets/demo/trained)")
    # Small runs (tests, trying settings): not the shipped recipe.
    train.add_argument("--batch", type=_positive, default=None, help=argparse.SUPPRESS)
    train.add_argument("--seq-len", type=_positive, default=None, help=argparse.SUPPRESS)
    train.add_argument("--freeze-docs", action="store_true",
                       help="first refresh the frozen copy of the project's docs the corpus reads "
                            "(assets/demo/corpus-docs.json.gz) from this checkout")
    train.add_argument("--corpus-bytes", type=_positive, default=None, help=argparse.SUPPRESS)
    train.add_argument("--eval-chunks", type=_positive, default=96, help=argparse.SUPPRESS)
    train.set_defaults(func=cmd_train_demos)
    ev = msub.add_parser("eval-demos", help="held-out perplexity of the trained demos vs the random-weight ones")
    ev.add_argument("--only", type=_id_list, default=None, metavar="ID,...", help="demo ids (default: all)")
    ev.add_argument("--dir", type=Path, default=None, help="trained folders (default: the shipped ones)")
    ev.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ev.add_argument("--eval-chunks", type=_positive, default=96, help=argparse.SUPPRESS)
    ev.set_defaults(func=cmd_eval_demos)


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


def cmd_train_demos(args: argparse.Namespace) -> int:
    from engine.models.demo import trained_recipe
    from engine.models.demo_corpus import build_corpus, compare_manifests
    from engine.models.demo_eval import format_table, heldout_table
    from engine.models.train_demos import TRAIN_ORDER, train_demos

    ids = args.only or TRAIN_ORDER
    if args.freeze_docs:
        from engine.models.demo_corpus import FROZEN_DOCS, freeze_docs

        print(f"froze {len(freeze_docs())} docs into {FROZEN_DOCS}")
    corpus = build_corpus(max_train_bytes=args.corpus_bytes)
    print(f"corpus {corpus.digest}: Python {corpus.python} stdlib + project docs, {len(corpus.files)} files "
          f"({len(corpus.split(True))} held out)")
    shipped = next((r for r in map(trained_recipe, ids) if r), None)
    if shipped is not None:
        diff = compare_manifests(shipped["corpus"], corpus.manifest())
        if diff:
            print(f"note: the shipped weights came from corpus {shipped['corpus']['digest']}; "
                  "this one differs, so the weights will too:")
            for line in diff:
                print(f"  {line}")
    overrides = {k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len)) if v is not None}
    progress = TerminalProgress()
    try:
        results = train_demos(only=ids, steps=args.steps, out_root=args.out, report=progress,
                              max_train_bytes=args.corpus_bytes, overrides=overrides, eval_count=args.eval_chunks)
        rows = heldout_table(ids, trained_root=results[0].out.parent, count=args.eval_chunks,
                             max_train_bytes=args.corpus_bytes, report=progress)
    finally:
        progress.close()
    for r in results:
        rec = r.recipe
        print(f"{r.demo_id}: {rec['train']['steps']} steps, {rec['tokens_seen']} tokens, {rec['seconds']:.0f} s "
              f"-> {r.out}")
    print(format_table(rows))
    return 0


def cmd_eval_demos(args: argparse.Namespace) -> int:
    from engine.models.demo_eval import format_table, heldout_table
    from engine.models.train_demos import TRAIN_ORDER

    progress = TerminalProgress()
    try:
        rows = heldout_table(args.only or TRAIN_ORDER, trained_root=args.dir, count=args.eval_chunks,
                             report=progress)
    finally:
        progress.close()
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _id_list(text: str) -> list[str]:
    from engine.models.train_demos import TRAIN_ORDER

    ids = [t.strip() for t in text.split(",") if t.strip()]
    bad = [i for i in ids if i not in TRAIN_ORDER]
    if not ids or bad:
        raise argparse.ArgumentTypeError(f"demo ids are {', '.join(TRAIN_ORDER)}; not {', '.join(bad) or text!r}")
    return ids


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a positive integer, not {text!r}")
    return n


def _entry_dict(e) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(e).items()}


def _human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
