"""The measured runs of `flotilla bench sparse`: a cold decode run of the sparse engine
and its I/O figures, the all-resident sparse and dense runs, the replayed-trace scenario
(OverlapTrace) and the disk probe of the neuron store.
"""

from __future__ import annotations

import time

REPLAY_JACCARD = (0.5, 0.85)  # scenario only: the overlap trained models show is 0.82-0.85 (paper)
CONTEXT = 1024  # KV reserved by the benchmark's engines (prompt + tokens fit many times over)


class OverlapTrace:
    """A replayed activation trace with a chosen overlap (benchmark scenario only):
    each decode token's set per layer has the true set's size, and shares with the
    previous token's set the share that gives Jaccard J: |A & B| = 2J/(1+J) * k."""

    def __init__(self, jaccard: float, neurons: int, seed: int = 0) -> None:
        import numpy as np

        self.j, self.neurons = jaccard, neurons
        self.rng = np.random.default_rng(seed)
        self.prev: dict[int, object] = {}

    def __call__(self, layer: int, need):
        import numpy as np

        k = len(need)
        prev = self.prev.get(layer)
        if prev is None:
            out = need
        else:
            m = min(len(prev), k, int(round(2 * self.j / (1 + self.j) * k)))
            keep = self.rng.choice(prev, m, replace=False)
            rest = np.setdiff1d(np.arange(self.neurons), prev, assume_unique=True)
            out = np.sort(np.concatenate([keep, self.rng.choice(rest, k - m, replace=False)]))
        self.prev[layer] = out
        return out


def decode_run(backend, ids: list[int], n: int) -> dict:
    import numpy as np

    rt = backend.rt
    rt.cache.clear()  # cold: every run starts with an empty neuron cache
    stream = backend.new_stream()
    logits = stream.prefill(ids)
    io1, pf1 = rt.store.stats.snapshot(), rt.prefetcher.stats.snapshot()
    rt.stats.jaccard_sum[:] = 0
    rt.stats.jaccard_n = 0
    times, out = [], []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    io2, pf2 = rt.store.stats.snapshot(), rt.prefetcher.stats.snapshot()
    stream.close()
    total = sum(times)
    jn = max(rt.stats.jaccard_n, 1)
    d = {k: pf2[k] - pf1[k] for k in pf2}
    dio = {k: io2[k] - io1[k] for k in io2}
    needed = max(1, d["needed"])
    wait = d["wait_s"] + dio["submit_s"]  # waiting for completions + blocked in io_submit on a full queue
    return {"tok_s": n / total, "bytes_per_token": dio["bytes_read"] / n, "reads_per_token": dio["reads"] / n,
            "io_share": wait / total, "io_wait_ms": 1e3 * wait / n,
            "verify_ms": 1e3 * dio["verify_s"] / n, "token_ms": 1e3 * total / n,
            "hit_rate": 1 - (d["on_demand"] + d["prefetch_used"]) / needed,
            "on_demand_share": d["on_demand"] / needed,
            "prefetch_precision": d["prefetch_used"] / d["prefetched"] if d["prefetched"] else None,
            "needed_per_token": d["needed"] / n,
            "jaccard_runtime": float((rt.stats.jaccard_sum / jn).mean()), "tokens": out}


def dense_run(model, ids: list[int], n: int, kv_dtype=None) -> dict:
    from engine.runtime.torch_backend import TorchStream

    stream = TorchStream(model, kv_dtype=kv_dtype)
    logits = stream.prefill(ids)
    times, out = [], []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    return {"tok_s": n / sum(times), "tokens": out}


def decode_run_warm(backend, ids, n):
    """All-resident: the cache already holds every neuron; nothing is read."""
    import numpy as np

    stream = backend.new_stream()
    logits = stream.prefill(ids)
    times = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        t = time.perf_counter()
        logits = stream.decode(tok)
        times.append(time.perf_counter() - t)
    stream.close()
    return {"tok_s": n / sum(times)}


def disk_probe(store_dir, bundle: int, report) -> dict:
    from engine.sparse.diskprobe import best_gap, probe

    report("probing the disk (O_DIRECT random reads at several sizes and queue depths)")
    files = sorted(store_dir.glob("layer-*.bin"))
    sizes = sorted({4096, bundle, 65536, 262144})
    try:
        res = probe(files, sizes=sizes, depths=(1, 16, 64, 256), budget_s=0.08, rounds=3)
    except OSError as e:  # a file system that refuses O_DIRECT: no probe (and no bound from it)
        report(f"disk probe skipped: {e}")
        return {"error": f"O_DIRECT probe failed: {e}", "bundle_bytes": bundle}
    at = {(r["size"], r["depth"]): r for r in res["random"]}
    res["bundle_bytes"] = bundle
    res["bundle_read_mb_s_best_depth"] = max(r["mb_s"] for r in res["random"] if r["size"] == bundle)
    res["bundle_read_mb_s_depth_1"] = at[(bundle, 1)]["mb_s"]
    res["best_gap_bundles"] = best_gap(res, bundle)
    return res
