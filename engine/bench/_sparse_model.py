"""The model of a `flotilla bench sparse` run: Llama-3.1-8B's published shapes, the
synthetic 8B-shaped recipe (in a chosen weight dtype) or a shipped demo model, and the
memory rule its engine runs under.
"""

from __future__ import annotations

REAL_LAYERS_QUICK, REAL_LAYERS_FULL = 12, 16  # llama-3.1-8b: decoder layers built (the checkpoint is 2x the cap)


def bench_recipe(quick: bool, layers: int | None = None, hidden: int = 4096, intermediate: int = 14336,
                 heads: int = 32, kv_heads: int = 8):
    from engine.models.demo import DemoRecipe

    layers = layers or (2 if quick else 4)
    shape = (hidden, intermediate, heads, kv_heads)
    name = (f"sparse-bench-h4096-{layers}l" if shape == (4096, 14336, 32, 8)  # the published model's name
            else f"sparse-bench-h{hidden}-i{intermediate}-a{heads}-kv{kv_heads}-{layers}l")
    return DemoRecipe(
        name, "LlamaConfig",
        dict(initializer_range=0.02, max_position_embeddings=4096, tie_word_embeddings=False,
             hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5),
        seed=11, description=(f"sparse bench: Llama-3-8B-shaped layers (hidden {hidden}, FFN {intermediate}), "
                              "random weights" if shape == (4096, 14336, 32, 8) else
                              f"sparse bench: small Llama (hidden {hidden}, FFN {intermediate}), random weights"),
        tokenizer_of="demo")


def with_dtype(path, dtype: str, report):
    """A copy of the model folder with the weights stored in `dtype` (bf16, f16; f32 = as built).
    Real checkpoints ship 16-bit weights; both the engine and the mmap baseline then read 16-bit."""
    import json
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    if dtype == "f32":
        return path
    out = path.with_name(f"{path.name}-{dtype}")
    if (out / "model.safetensors").exists():
        return out
    report(f"writing a {dtype} copy of the benchmark model (once)")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    for f in path.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.to(tdt).contiguous() for k, v in load_file(path / "model.safetensors").items()},
              tmp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16"}[dtype]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def real_spec(layers: int | None, quick: bool):
    """Llama-3.1-8B's published shapes (vocab 128256, bf16, sharded) with `layers` layers."""
    from engine.bench._checkpoint import LLAMA_3_1_8B

    n = layers or (REAL_LAYERS_QUICK if quick else REAL_LAYERS_FULL)
    return LLAMA_3_1_8B.scaled(name=f"{LLAMA_3_1_8B.name}-{n}l", num_layers=n)


def bench_model(args, quick: bool, report) -> dict:
    """The benchmark checkpoint and the memory rule its engine runs under."""
    from engine.models.demo import ensure_recipe

    if args.shape == "demo":
        from engine.models.demo import ensure_demo, is_demo_id

        if not is_demo_id(args.model):
            raise SystemExit(f"--model {args.model}: not a demo id")
        return {"path": ensure_demo(args.model, lambda m, f: report(m)), "dtype": "f32",
                "mode": args.mode or "exact", "limit": None, "checkpoint": None}
    if args.shape == "synthetic":
        recipe = bench_recipe(quick, args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
        path = with_dtype(ensure_recipe(recipe, lambda m, f: report(m)), args.dtype, report)
        return {"path": path, "dtype": args.dtype, "mode": args.mode or "exact", "limit": None, "checkpoint": None}
    from engine.bench._cgroup import require_v1
    from engine.bench._checkpoint import checkpoint_bytes, ensure_checkpoint

    require_v1()  # no cap, no figures: the real shape never runs uncapped
    spec = real_spec(args.layers, quick)
    path = ensure_checkpoint(spec, report=report)
    ckpt = checkpoint_bytes(path)
    return {"path": path, "dtype": "bf16", "mode": args.mode or "predicted", "checkpoint": path,
            "checkpoint_bytes": ckpt, "limit": int(ckpt * args.cap_fraction), "spec": spec.name}
