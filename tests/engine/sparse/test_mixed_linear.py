"""mixed_linear (16-bit weights, f32 activations) holds no copy of its weight, whatever the
input's strides: the 16-bit head of an 8B model is 1 GB, and a transient copy of it on
every prefill is what OOM-killed the sparse engine under a cap. Measured in a fresh
process by its peak RSS (ru_maxrss), so nothing else in the test session blurs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from engine.sparse.weights import mixed_linear
torch.set_grad_enabled(False)
w = torch.empty(32768, 4096, dtype=torch.bfloat16).normal_()   # 256 MiB, made in place (no f32 peak)
hidden = torch.randn(1, 10, 4096)
ref = torch.cat([torch.nn.functional.linear(hidden[0, -1:, :], w[i:i + 4096].float()) for i in range(0, 32768, 4096)], -1)[None]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
y = mixed_linear(hidden[:, -1:, :], w)   # the last-position slice transformers hands the head
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew": grew * 1024, "err": float((y - ref).abs().max()), "scale": float(ref.abs().max()),
                  "shape": list(y.shape), "dtype": str(y.dtype)}))
"""


def test_mixed_linear_on_a_strided_input_does_not_copy_its_weight():
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["grew"] < 32 << 20, f"peak RSS grew by {r['grew'] >> 20} MiB for a 256 MiB weight"
    assert r["shape"] == [1, 1, 32768] and r["dtype"] == "torch.float32"
    assert r["err"] <= 0.02 * r["scale"]  # bf16 rounding of x, f32 accumulation
