"""Synthetic drafts for tests and benchmarks: the target plus weight noise.

`noisy_draft(target, sigma)` writes a copy of a Hugging Face folder whose
every weight tensor w became w + sigma * std(w) * N(0, 1) (a fixed seed), and
optionally keeps only its first `layers` decoder layers (a layer-skip draft:
much cheaper, and close to the target when the skipped layers contribute
little). sigma tunes the acceptance rate: 0 accepts everything (greedy, all
layers kept), larger values accept less. Built once into the model cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

WEIGHTS = "model.safetensors"
LAYER_PREFIX = "model.layers."


def noisy_draft(target: Path, sigma: float, layers: int | None = None, seed: int = 0,
                root: Path | None = None) -> Path:
    """The folder of the noisy (and maybe truncated) copy of `target`."""
    from engine.models.demo import cache_root

    target = Path(target)
    tag = f"{target.name}-noisy-s{sigma:g}-l{layers if layers is not None else 'all'}-r{seed}"
    out = (root or cache_root() / "drafts") / tag
    if (out / WEIGHTS).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=out.parent))
    try:
        _write(target, tmp, sigma, layers, seed)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / WEIGHTS).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(target: Path, out: Path, sigma: float, layers: int | None, seed: int) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    for f in target.iterdir():
        if f.is_file() and f.name not in (WEIGHTS, "config.json", "flotilla-demo.json"):
            shutil.copy2(f, out / f.name)
    config = json.loads((target / "config.json").read_text())
    weights = load_file(str(target / WEIGHTS))
    rng = np.random.default_rng(seed)
    kept = {}
    for name in sorted(weights):
        if layers is not None and name.startswith(LAYER_PREFIX):
            if int(name[len(LAYER_PREFIX):].split(".")[0]) >= layers:
                continue
        w = weights[name].astype(np.float32)
        if sigma > 0 and w.ndim >= 1 and w.size > 1:
            w = w + np.float32(sigma) * np.float32(w.std() or 1.0) * rng.standard_normal(w.shape, np.float32)
        kept[name] = np.ascontiguousarray(w)
    if layers is not None:
        config["num_hidden_layers"] = layers
        for key in ("layer_types",):
            if isinstance(config.get(key), list):
                config[key] = config[key][:layers]
    save_file(kept, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def damped_target(source: Path, keep_layers: int, scale: float, root: Path | None = None) -> Path:
    """A copy of `source` whose decoder layers from `keep_layers` on write scale x
    their usual residual update (o_proj and down_proj scaled): the same compute,
    but a model that its first `keep_layers` layers predict well, so a cheap
    layer-skip draft (noisy_draft(..., layers=keep_layers)) can reach high acceptance."""
    from engine.models.demo import cache_root

    source = Path(source)
    tag = f"{source.name}-damped-k{keep_layers}-x{scale:g}"
    out = (root or cache_root() / "drafts") / tag
    if (out / WEIGHTS).exists():
        return out
    import numpy as np
    from safetensors.numpy import load_file, save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=out.parent))
    try:
        for f in source.iterdir():
            if f.is_file() and f.name not in (WEIGHTS, "flotilla-demo.json"):
                shutil.copy2(f, tmp / f.name)
        weights = load_file(str(source / WEIGHTS))
        for name, w in weights.items():
            if name.startswith(LAYER_PREFIX) and int(name[len(LAYER_PREFIX):].split(".")[0]) >= keep_layers \
                    and name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = np.ascontiguousarray(w * np.float32(scale))
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / WEIGHTS).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
