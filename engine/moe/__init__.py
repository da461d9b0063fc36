"""MoE expert offloading: expert store on disk, RAM expert cache, fetch threads,
and the Bevy scheduler (with on-demand, prefetch and all-resident baselines).

    from engine.moe.engine import MoEEngine, MoEConfig
    engine = MoEEngine.from_spec("demo-moe", MoEConfig(scheduler="bevy"))

Modules: store (blobs, O_DIRECT, checksums), convert (HF checkpoint -> store),
cache (budget, slots, eviction), fetcher (thread pool), model (resident
weights, per-layer steps), scheduler (Bevy + baselines), engine (Engine API),
recipes (tiny random MoE models for tests and the benchmark).
"""
