"""One `flotilla bench sparse` decode run of the sparse engine in a capped child process:

    python -m engine.bench._sparse_cell '{"path": ..., "config": {...}, "ids": [...], "tokens": 12}'

It opens the engine (the parent already built the store and the calibration), drops the
checkpoint's pages from the page cache, prints READY and waits for GO while the parent caps
its memory group (engine.sparse.baseline.run_capped_child: the same allowance the mmap
baseline gets), decodes, and prints the figures of engine.bench._sparse_runs.decode_run as JSON.
Under a cap set from its first byte with no budget given, the engine picks its cache budget
itself (what a user gets); if no budget fits, the first line is {"error": "<its one line>"}."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch

    from engine.bench._sparse_runs import decode_run
    from engine.sparse.baseline import drop_page_cache
    from engine.sparse.cache import BudgetError
    from engine.models.profile import DEFAULT_CONTEXT
    from engine.platform.memory import settle_heap
    from engine.sparse.engine import SparseBackend, SparseConfig
    from engine.sparse.store import StoreConfig
    from engine.sparse.weights import safetensors_files

    torch.set_grad_enabled(False)
    cell = json.loads(argv[0])
    path = Path(cell["path"])
    config = dict(cell["config"])
    store = StoreConfig(**config.pop("store"))
    cfg = SparseConfig(**config, store=store)
    try:
        backend = SparseBackend(path, cfg, context_length=cfg.context_length or DEFAULT_CONTEXT)
    except BudgetError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 0
    settle_heap()  # as `flotilla chat` and `serve` do once their engine is open
    drop_page_cache(safetensors_files(path))
    print("READY", flush=True)
    sys.stdin.readline()
    figures = decode_run(backend, cell["ids"], int(cell["tokens"]))
    figures["cache_budget_bytes"] = backend.rt.cache.budget_bytes
    figures["io_info"] = backend.rt.store.io_info()
    backend.close()
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
