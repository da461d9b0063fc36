"""Which neurons will fire: a low-rank predictor (Deja Vu) and the previous
token's active set (temporal locality), with recall and precision.

A neuron is active when |act(gate . x)| > tau (CATS); for the gated FFNs the
engine supports that depends on the gate pre-activation only, a linear map of
x. The low-rank predictor approximates it with rank r << h:
    logits = (x @ A) @ B + c        x [T, h], A [h, r], B [r, N], c [N]
initialised from the truncated SVD of the gate matrix (the best rank-r
approximation of it) and then trained with BCE on calibration activations,
which also lets the "one layer ahead" predictor (x of layer l-1 -> active set
of layer l) learn how the residual stream moves between layers.
A per-layer cutoff on the logits is chosen for a target recall.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PredictorConfig:
    rank: int = 64  # r: low-rank width (memory: r * (h + N) floats per predictor)
    steps: int = 30  # Adam steps of BCE training (the SVD init already does most of the work)
    max_rows: int = 384  # calibration tokens per step (a random subset: CPU time, not accuracy, limits)
    lr: float = 3e-3  # Adam learning rate
    target_recall: float = 0.95  # cutoff chosen so this share of active neurons is predicted


class LowRankPredictor(torch.nn.Module):
    def __init__(self, hidden: int, neurons: int, rank: int) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.zeros(hidden, rank))  # [h, r]
        self.B = torch.nn.Parameter(torch.zeros(rank, neurons))  # [r, N]
        self.c = torch.nn.Parameter(torch.zeros(neurons))  # [N]
        self.register_buffer("cutoff", torch.zeros(()))  # logits above this = predicted active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.A) @ self.B + self.c  # [T, N] logits

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted active mask [T, N] (bool)."""
        with torch.no_grad():
            return self(x) > self.cutoff

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parameters()) * 4


def train_predictor(x: torch.Tensor, gate_w: torch.Tensor, active: torch.Tensor, tau: float,
                    cfg: PredictorConfig = PredictorConfig()) -> LowRankPredictor:
    """x [T, h] inputs the predictor will see; gate_w [N, h]; active [T, N] bool targets."""
    N, h = gate_w.shape
    r = min(cfg.rank, h, N)
    p = LowRankPredictor(h, N, r)
    with torch.no_grad():  # SVD init: logits ~ gate pre-activation minus a threshold
        if min(N, h) > 1024:  # big layers: a randomized rank-r SVD (seconds, not minutes)
            U, S, V = torch.svd_lowrank(gate_w.float(), q=min(r + 16, min(N, h)), niter=2)
            Vh = V.T
        else:
            U, S, Vh = torch.linalg.svd(gate_w.float(), full_matrices=False)  # [N, k], [k], [k, h]
        p.A.copy_(Vh[:r].T * S[:r].sqrt())  # [h, r]
        p.B.copy_((U[:, :r] * S[:r].sqrt()).T)  # [r, N]
        p.c.fill_(-float(tau))
    y = active.float()
    pos = y.mean().clamp(1e-4, 1 - 1e-4)
    weight = ((1 - pos) / pos).clamp(max=20.0)  # rare positives: weigh them up (recall matters)
    opt = torch.optim.Adam(p.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)
    with torch.enable_grad():  # callers (engines, benchmarks) often run with grad off
        for _ in range(cfg.steps):
            rows = torch.randperm(len(x), generator=gen)[:cfg.max_rows]
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(p(x[rows]), y[rows], pos_weight=weight)
            loss.backward()
            opt.step()
    # Training is over: drop the last gradients (as big as the predictor) and freeze it, or
    # every layer's predictor would hold twice its size for the life of the engine.
    p.zero_grad(set_to_none=True)
    p.requires_grad_(False)
    set_cutoff(p, x, active, cfg.target_recall)
    return p


def set_cutoff(p: LowRankPredictor, x: torch.Tensor, active: torch.Tensor, target_recall: float) -> None:
    with torch.no_grad():
        logits = p(x)[active]
        if logits.numel() == 0:
            p.cutoff.fill_(float("inf"))
            return
        p.cutoff.fill_(float(torch.quantile(logits.float()[:100_000], 1.0 - target_recall)))


def recall_precision(pred: torch.Tensor | np.ndarray, true: torch.Tensor | np.ndarray) -> tuple[float, float]:
    """Over all (token, neuron) pairs: recall = |pred & true| / |true|, precision = .../|pred|."""
    pred, true = np.asarray(pred, dtype=bool), np.asarray(true, dtype=bool)
    tp = float(np.logical_and(pred, true).sum())
    return (tp / max(1.0, float(true.sum())), tp / max(1.0, float(pred.sum())))


def temporal_prediction(active: np.ndarray) -> np.ndarray:
    """The previous token's active set as the prediction: [T, N] -> [T-1, N] for tokens 1..T-1."""
    return np.asarray(active[:-1], dtype=bool)


def jaccard_consecutive(active: np.ndarray) -> float:
    """Mean Jaccard |A_t & A_t+1| / |A_t | A_t+1| over consecutive tokens (active [T, N])."""
    a = np.asarray(active, dtype=bool)
    if len(a) < 2:
        return float("nan")
    inter = np.logical_and(a[1:], a[:-1]).sum(1)
    union = np.logical_or(a[1:], a[:-1]).sum(1)
    return float(np.mean(inter / np.maximum(union, 1)))
