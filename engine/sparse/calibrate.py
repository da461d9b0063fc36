"""Calibration: per-layer activation thresholds and predictors from sample text.

Runs the dense model over the text one decoder layer at a time, from the
memory-mapped checkpoint (engine/sparse/layerwise.py: no weight copied, one
layer's FFN inputs in RAM at a time), records every FFN's input x and gate
pre-activation g, and derives:
  - tau_l: ReLU-family models use their natural zeros (tau = 0, relu(g) > 0);
    SwiGLU models use the quantile of |silu(g)| that zeroes the target share
    of neurons (CATS). Sparsity 0 keeps every neuron (the exact dense model).
  - the low-rank predictors: own (x_l -> active_l, decides what predicted mode
    computes) and ahead (x_{l-1} -> active_l, what the prefetcher reads one
    layer early), plus their recall / precision on held-out text, and those of
    the previous token's active set (temporal locality).
The text is split: the first 80 % calibrates, the last 20 % is held out.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.models.demo import CORPUS_PATH, cache_root
from engine.sparse.predictor import (LowRankPredictor, PredictorConfig, jaccard_consecutive,
                                     recall_precision, temporal_prediction, train_predictor)
from engine.sparse.weights import ffn_layout

Progress = Callable[[str, float], None]
CALIB_VERSION = 2  # 2: recorded layer by layer from the mmap-backed model
HELD_OUT = 0.2  # share of the text kept for evaluation
SEQ = 256  # tokens per calibration sequence (independent sequences)


@dataclass(frozen=True)
class CalibConfig:
    sparsity: float = 0.8  # SwiGLU target: share of neurons zeroed per token (0 = dense, exact)
    text: Path | None = None  # sample text (None = assets/demo/corpus.txt)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)


@dataclass
class Calibration:
    sparsity: float  # the target (SwiGLU) or the measured natural sparsity (ReLU)
    act: str  # activation function of the model
    thresholds: list[float]  # tau per layer on |act(g)|
    own: list[LowRankPredictor | None]  # x_l -> active_l (None: all neurons, sparsity 0)
    ahead: list[LowRankPredictor | None]  # x_{l-1} -> active_l (None for layer 0)
    max_active: list[int]  # largest per-token active count seen, per layer
    max_predicted: list[int]  # largest per-token predicted set of the own predictor, per layer
    mean_active: list[float]  # mean per-token active count, per layer
    stats: dict = field(default_factory=dict)  # recall / precision / Jaccard per layer (held out)

    @property
    def all_active(self) -> bool:
        return all(o is None for o in self.own)

    def predictor_bytes(self) -> int:
        return sum(p.nbytes for p in self.own + self.ahead if p is not None)

    def save(self, path: Path) -> None:
        blob = {"version": CALIB_VERSION, "sparsity": self.sparsity, "act": self.act,
                "thresholds": self.thresholds, "max_active": self.max_active,
                "mean_active": self.mean_active, "stats": self.stats, "max_predicted": self.max_predicted,
                "own": [_state(p) for p in self.own], "ahead": [_state(p) for p in self.ahead]}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(blob, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        blob = torch.load(path, weights_only=False)
        if blob.get("version") != CALIB_VERSION:
            raise ValueError(f"calibration {path} has an old version; recalibrate")
        return cls(sparsity=blob["sparsity"], act=blob["act"], thresholds=blob["thresholds"],
                   own=[_predictor(s) for s in blob["own"]], ahead=[_predictor(s) for s in blob["ahead"]],
                   max_active=blob["max_active"], mean_active=blob["mean_active"], stats=blob["stats"],
                   max_predicted=blob["max_predicted"])


def _state(p: LowRankPredictor | None):
    return None if p is None else {k: v.clone() for k, v in p.state_dict().items()}


def _predictor(state) -> LowRankPredictor | None:
    if state is None:
        return None
    h, r = state["A"].shape
    p = LowRankPredictor(h, state["B"].shape[1], r)
    p.load_state_dict(state)
    return p.eval()


# --------------------------------------------------------------------------- where things live

def work_dir(model_dir: Path) -> Path:
    """Per-model folder for the stores and calibrations, keyed by the weights' identity."""
    model_dir = Path(model_dir).resolve()
    h = hashlib.sha256(str(model_dir).encode())
    for f in sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return cache_root() / "sparse" / f"{model_dir.name}-{h.hexdigest()[:12]}"


def calib_path(model_dir: Path, cfg: CalibConfig) -> Path:
    text = cfg.text or CORPUS_PATH
    digest = hashlib.sha256(Path(text).read_bytes()).hexdigest()[:8]
    p = cfg.predictor
    return work_dir(model_dir) / f"calib-s{cfg.sparsity:.3f}-r{p.rank}-{digest}.pt"


# --------------------------------------------------------------------------- activations

def text_ids(tokenizer, text_path: Path | None) -> tuple[list[list[int]], list[int]]:
    """(calibration sequences, held-out ids) of a text file."""
    text = Path(text_path or CORPUS_PATH).read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 40:
        raise ValueError(f"the calibration text has only {len(ids)} tokens; give at least a few hundred")
    cut = int(len(ids) * (1 - HELD_OUT))
    calib, held = ids[:cut], ids[cut:]
    return [calib[i:i + SEQ] for i in range(0, len(calib), SEQ) if len(calib[i:i + SEQ]) > 8], held


def activation(act: str):
    from transformers.activations import ACT2FN

    return ACT2FN[act]


def active_mask(g: torch.Tensor, act_fn, tau: float) -> torch.Tensor:
    """[T, N] bool: neurons whose |act(g)| exceeds tau (tau 0 -> every nonzero one)."""
    return act_fn(g).abs() > tau


# --------------------------------------------------------------------------- calibrate

def calibrate(model_dir: Path, cfg: CalibConfig = CalibConfig(), progress: Progress | None = None,
              model=None, tokenizer=None) -> Calibration:
    """model: the dense model to run (default: the mmap-backed one of layerwise.mapped_dense)."""
    from transformers import AutoTokenizer

    from engine.sparse.layerwise import gate_weight, layer_inputs, mapped_dense

    report = progress or (lambda _m, _f: None)
    layout = ffn_layout(model_dir)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    model = model or mapped_dense(model_dir)
    seqs, held = text_ids(tokenizer, cfg.text)
    report("recording FFN activations on the calibration text, layer by layer", 0.05)
    held_seqs = [held[i:i + SEQ] for i in range(0, len(held), SEQ)]
    act_fn = activation(layout.act)
    relu = layout.relu_family
    taus, own, ahead, max_act, mean_act, max_pred = [], [], [], [], [], []
    stats: dict[str, list] = {k: [] for k in ("sparsity", "own_recall", "own_precision", "ahead_recall",
                                              "ahead_precision", "temporal_recall", "temporal_precision",
                                              "jaccard")}
    prev: tuple[torch.Tensor, torch.Tensor] | None = None  # layer l-1's inputs (the ahead predictor's)
    for l, (x_c, x_h) in layer_inputs(model, [seqs, held_seqs]):
        report(f"layer {l + 1}/{layout.num_layers}: threshold and predictors", 0.1 + 0.85 * l / layout.num_layers)
        wg = gate_weight(model, layout, l)  # [N, h]
        x_prev, prev = prev, (x_c, x_h)
        with torch.no_grad():
            g, gh = x_c @ wg.T, x_h @ wg.T  # [T, N]
            mag = act_fn(g).abs()
        if relu:
            tau = 0.0
        elif cfg.sparsity <= 0:
            tau = 0.0
        else:
            tau = float(torch.quantile(mag.flatten()[torch.randperm(mag.numel(), generator=torch.Generator().manual_seed(l))[:2_000_000]], cfg.sparsity))
        taus.append(tau)
        act_c, act_h = active_mask(g, act_fn, tau), active_mask(gh, act_fn, tau)
        max_act.append(int(act_c.sum(1).max()))
        mean_act.append(float(act_c.sum(1).float().mean()))
        stats["sparsity"].append(1.0 - float(act_h.float().mean()))
        stats["jaccard"].append(jaccard_consecutive(act_h.numpy()))
        tr, tp = recall_precision(temporal_prediction(act_h.numpy()), act_h.numpy()[1:])
        stats["temporal_recall"].append(tr)
        stats["temporal_precision"].append(tp)
        if not relu and tau == 0.0:  # every neuron active: nothing to predict
            own.append(None)
            ahead.append(None)
            max_pred.append(layout.neurons)
            for k in ("own_recall", "own_precision", "ahead_recall", "ahead_precision"):
                stats[k].append(1.0)
            continue
        p_own = train_predictor(x_c, wg, act_c, tau, cfg.predictor).eval()
        own.append(p_own)
        max_pred.append(int(p_own.predict(x_c).sum(1).max()))
        r, p = recall_precision(p_own.predict(x_h).numpy(), act_h.numpy())
        stats["own_recall"].append(r)
        stats["own_precision"].append(p)
        if x_prev is None:
            ahead.append(None)
            stats["ahead_recall"].append(float("nan"))
            stats["ahead_precision"].append(float("nan"))
            continue
        p_ahead = train_predictor(x_prev[0], wg, act_c, tau, cfg.predictor).eval()
        ahead.append(p_ahead)
        r, p = recall_precision(p_ahead.predict(x_prev[1]).numpy(), act_h.numpy())
        stats["ahead_recall"].append(r)
        stats["ahead_precision"].append(p)
    natural = 1.0 - float(np.mean([m / layout.neurons for m in mean_act]))
    report("calibration done", 1.0)
    return Calibration(sparsity=natural if relu else cfg.sparsity, act=layout.act, thresholds=taus,
                       own=own, ahead=ahead, max_active=max_act, mean_active=mean_act, max_predicted=max_pred,
                       stats={k: [None if isinstance(v, float) and math.isnan(v) else v for v in vals]
                              for k, vals in stats.items()})


def ensure_calibration(model_dir: Path, cfg: CalibConfig = CalibConfig(),
                       progress: Progress | None = None) -> Calibration:
    """Load the saved calibration for (model, sparsity, rank, text), computing it once."""
    path = calib_path(model_dir, cfg)
    if path.exists():
        try:
            return Calibration.load(path)
        except Exception:  # an old or damaged file: recompute
            pass
    calib = calibrate(model_dir, cfg, progress)
    calib.save(path)
    return calib


def summary(calib: Calibration) -> dict:
    """Plain numbers for reports."""
    s = calib.stats

    def avg(key):
        vals = [v for v in s.get(key, []) if v is not None]
        return round(float(np.mean(vals)), 4) if vals else None

    return {"sparsity_target": calib.sparsity, "sparsity_measured": avg("sparsity"),
            "thresholds": [round(t, 5) for t in calib.thresholds],
            "own_recall": avg("own_recall"), "own_precision": avg("own_precision"),
            "ahead_recall": avg("ahead_recall"), "ahead_precision": avg("ahead_precision"),
            "temporal_recall": avg("temporal_recall"), "temporal_precision": avg("temporal_precision"),
            "jaccard_per_layer": [round(v, 4) for v in s.get("jaccard", [])],
            "jaccard_mean": avg("jaccard"), "predictor_bytes": calib.predictor_bytes()}


__all__ = ["CalibConfig", "Calibration", "calibrate", "ensure_calibration", "summary", "work_dir",
           "asdict"]
