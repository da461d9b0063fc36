"""The model of a `flotilla bench moe` run and its expert store: a published shape
(random bf16 weights, capped), the synthetic model, or a shipped demo MoE.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable


def demo_model(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench._checkpoint import checkpoint_bytes
    from engine.models.demo import is_demo_id
    from engine.models.ref import resolve_model
    from engine.moe.convert import ensure_store

    if not is_demo_id(args.model):
        raise SystemExit(f"--model {args.model}: not a demo id")
    resolved = resolve_model(args.model)
    return {"store_dir": ensure_store(resolved.path, resolved.fingerprint), "model_id": args.model,
            "checkpoint_bytes": checkpoint_bytes(resolved.path)}


def synthetic_model(args: argparse.Namespace, quick: bool, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench._checkpoint import checkpoint_bytes
    from engine.models.demo import ensure_recipe
    from engine.moe.convert import ensure_store
    from engine.moe.recipes import bench_recipe

    recipe = bench_recipe(args.layers or (16 if quick else 24), args.experts or (32 if quick else 64),
                          args.hidden, args.expert_inter)
    report(f"building {recipe.demo_id} (first run only)")
    path = ensure_recipe(recipe)
    return {"store_dir": ensure_store(path, recipe.fingerprint()), "model_id": recipe.demo_id,
            "checkpoint_bytes": checkpoint_bytes(path)}


def real_spec(shape: str, layers: int | None):
    """The checkpoint spec of a published shape with `layers` decoder layers."""
    from engine.bench._checkpoint import MIXTRAL_8X7B, QWEN3_30B_A3B

    base = {"qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B}[shape]
    n = layers or (4 if shape == "qwen3-30b-a3b" else 2)
    return base.scaled(name=f"{base.name}-{n}l", num_layers=n)


def real_model(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from engine.bench._cgroup import require_v1
    from engine.bench._checkpoint import checkpoint_bytes, ensure_checkpoint
    from engine.models.ref import resolve_model
    from engine.moe.convert import ensure_store

    require_v1()  # no cap, no figures: never run uncapped
    spec = real_spec(args.shape, args.layers)
    path = ensure_checkpoint(spec, report=report)
    ckpt = checkpoint_bytes(path)
    resolved = resolve_model(str(path))
    t = time.time()
    store_dir = ensure_store(path, resolved.fingerprint, lambda m, f: report(f"  {m}") if f >= 1 else None)
    report(f"expert store ready in {time.time() - t:.0f} s: {store_dir}")
    return {"store_dir": store_dir, "model_id": spec.name, "checkpoint_bytes": ckpt, "checkpoint": path,
            "cap_bytes": int(ckpt * args.cap_fraction)}
