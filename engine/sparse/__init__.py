"""The sparse-FFN engine (NeuroPrefetcher): FFN neurons live on storage as
4 KiB-aligned bundles; a RAM neuron cache holds some; a small predictor guesses
the next layer's active set and only the delta (predicted - resident) is read,
overlapped with compute. Attention and embeddings stay resident.

Files, one concept each:
    weights.py    which tensors are FFN neurons; a model skeleton; mmap'd safetensors
    store.py      the neuron-bundle store (build, checksums, O_DIRECT coalesced reads into cache slots)
    aio.py        batched O_DIRECT reads through Linux native AIO (one io_submit per batch)
    diskprobe.py  fio-like probe: random-read throughput by size and queue depth; the gap rule
    cache.py      the RAM neuron cache (byte budget, LRU, slots reads land in, resize while running)
    predictor.py  low-rank (Deja Vu) and previous-token predictors, recall/precision
    calibrate.py  thresholds (CATS) and predictors from sample text; saved per model
    prefetch.py   delta prefetch on a thread pool, on-demand fetch of the misses
    model.py      SparseMLP (the FFN replacement) and the per-request stream
    memory.py     free-RAM watching and budget policy
    engine.py     SparseEngine (the Engine interface) and the factory opener
    profile.py    measured overlap (Jaccard) of consecutive tokens' active sets
    quality.py    top-1 agreement and perplexity against dense
    baseline.py   the dense-through-mmap baseline under a cgroup memory cap
"""
