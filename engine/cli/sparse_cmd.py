"""`flotilla sparse calibrate|profile`: thresholds, predictors and the measured
temporal locality of a model's FFN activations (for the sparse engine)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.cli.errors import UserError
from engine.cli.progress import TerminalProgress


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sparse", help="sparse-FFN engine tools: calibrate thresholds/predictors, profile overlap")
    ssub = p.add_subparsers(dest="sparse_command", metavar="ACTION", required=True)

    c = ssub.add_parser("calibrate", help="compute per-layer thresholds and train the predictors on sample text")
    _common(c)
    c.add_argument("--rank", type=int, default=64, help="low-rank predictor width (default 64)")
    c.add_argument("--quality", action="store_true",
                   help="also report top-1 agreement and perplexity change against dense on held-out text")
    c.set_defaults(func=cmd_calibrate)

    pr = ssub.add_parser("profile", help="measure the overlap (Jaccard) of consecutive tokens' active sets")
    _common(pr)
    pr.set_defaults(func=cmd_profile)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="demo", help="demo id, local HF folder or hub id (default: demo)")
    p.add_argument("--text", type=Path, default=None,
                   help="sample text file (default: assets/demo/corpus.txt); the last 20%% is held out")
    p.add_argument("--sparsity", type=float, default=0.8,
                   help="SwiGLU target share of zeroed neurons, 0..0.99 (ReLU models use natural zeros)")
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the result as JSON")


def _resolve(args: argparse.Namespace) -> Path:
    from engine.models import resolve_model

    if not 0.0 <= args.sparsity < 1.0:
        raise UserError(f"--sparsity must be in [0, 1), got {args.sparsity}")
    if args.text is not None and not args.text.is_file():
        raise UserError(f"--text {args.text}: no such file")
    progress = TerminalProgress()
    try:
        resolved = resolve_model(args.model, progress)
    finally:
        progress.close()
    if resolved.kind == "openvino":
        raise UserError("the sparse engine needs a Hugging Face (safetensors) folder, not an OpenVINO IR")
    return Path(resolved.path)


def _emit(result: dict, args: argparse.Namespace) -> None:
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.sparse.calibrate import CalibConfig, calib_path, calibrate, summary
    from engine.sparse.predictor import PredictorConfig

    path = _resolve(args)
    cfg = CalibConfig(sparsity=args.sparsity, text=args.text, predictor=PredictorConfig(rank=args.rank))
    progress = TerminalProgress()
    try:
        calib = calibrate(path, cfg, progress)
    except ValueError as e:
        raise UserError(str(e)) from None
    finally:
        progress.close()
    out = calib_path(path, cfg)
    calib.save(out)
    result = {"model": args.model, "saved": str(out), **summary(calib)}
    if args.quality:
        from engine.sparse.quality import evaluate

        result["quality"] = evaluate(path, {str(args.sparsity): calib}, text=args.text)
    print(f"calibration saved to {out}", file=sys.stderr)
    _emit(result, args)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from engine.sparse.profile import overlap_profile

    path = _resolve(args)
    try:
        result = overlap_profile(path, args.sparsity, args.text)
    except ValueError as e:
        raise UserError(str(e)) from None
    result["model"] = args.model
    _emit(result, args)
    return 0
