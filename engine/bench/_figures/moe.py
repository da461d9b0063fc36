"""docs/moe.md's figure tables (see engine/bench/_figures/__init__.py for the rules).

Four sources: `moe-quick` (Qwen3-30B-A3B shapes, `flotilla bench moe --quick`, on an Intel
CPU with a bf16 kernel), `moe-quick-avx2` (the same on an AVX2-only CPU, with Bevy in torch's
bf16 product beside it), `moe-quick-epyc-bf16` (the same on an AMD EPYC with AVX-512 bf16, with
each run's CPU time, GC pauses and compute by step) and `moe-mixtral` (Mixtral-8x7B shapes).
The per-scheduler and overlap-bound tables have more than three columns: a row's figure then
holds several cells separated by " | ", and the header names every column (the first is the
row's `what`, the last its `how`).
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

_WITH_ABLATIONS = ("`flotilla bench moe --quick --schedulers "
                   "bevy,on_demand,prefetch,bevy_native,bevy_two_waves,bevy_guess`")
SOURCES = {"moe-quick": "`flotilla bench moe --quick`",
           "moe-quick-avx2": _WITH_ABLATIONS,
           "moe-quick-epyc-bf16": "`flotilla bench moe --quick --schedulers "
                                  "bevy,on_demand,prefetch,bevy_two_waves,bevy_guess`",
           "moe-mixtral": "`flotilla bench moe --shape mixtral-8x7b --tokens 8`"}
SCHEDULERS = ("bevy", "on_demand", "prefetch")
CONCURRENCY = ("1", "4", "16")


def _f(src: str, path: str, fmt: str) -> str:
    return "{" + f"{src}:{path}|{fmt}" + "}"


def _headline(src: str) -> Table:
    how = SOURCES[src]

    def f(path: str, fmt: str) -> str:
        return _f(src, path, fmt)

    return Table(f"{src}-headline", ("what", "figure", "how"), (
        Row("model (random weights, published per-layer shapes)",
            f"{{{src}:model.shape}}: {f('model.layers', 'int')} layers × {f('model.experts_per_layer', 'int')} "
            f"experts, top-{f('model.top_k', 'int')}, hidden {f('model.hidden', 'int')}, expert width "
            f"{f('model.expert_intermediate', 'int')}, {{{src}:model.dtype}}, {f('model.expert_mb', 'f2')} MB per "
            f"expert; checkpoint {f('model.checkpoint_mb', 'f0')} MB", how),
        Row("memory cap of every engine process (cgroup v1, page cache included)",
            f"{f('cap.cap_mb', 'f0')} MB: the checkpoint is {f('cap.checkpoint_over_cap', 'f2')}× the cap; "
            f"highest group peak {f('cap.max_usage_mb', 'f0')} MB, OOM kills {f('cap.oom_kills', 'int')}", how),
        Row("expert cache the engine chose under the cap",
            f"{f('cache_budget_mb', 'f0')} MB = {f('cache_fraction', 'pct')} of the experts", how),
        Row("Bevy over on_demand (tok/s ratio)",
            f"{f('speedup_vs_on_demand', 'x')} at {f('concurrency_for_speedups', 'int')} requests "
            f"(goal {f('goals.speedup_vs_on_demand', 'x')}; I/O: {{{src}:io.effective}})", how),
        Row("Bevy over prefetch (tok/s ratio)",
            f"{f('speedup_vs_prefetch', 'x')} at {f('concurrency_for_speedups', 'int')} requests "
            f"(goal {f('goals.speedup_vs_prefetch', 'x')}; I/O: {{{src}:io.effective}})", how),
        Row("disk, the engine's reader (4 threads, median of a run's repeats)", f"{f('disk_mb_s', 'f0')} MB/s", how),
        Row("wall time of one run", f"{f('wall_s', 'f0')} s", how),
        *(_quality(src) if src in MEASURES_QUALITY else ()),
        *(_guess(src) if src in RUNS_GUESS else ()),
        *(_one_wave(src) if src in RUNS_ONE_WAVE else ()),
        *(_two_waves(src) if src in RUNS_TWO_WAVES else ()),
        *(_verify_always(src) if src in RUNS_VERIFY_ALWAYS else ()),
        *(_compute_variant(src) if src in RUNS_COMPUTE_VARIANT else ()),
    ))


# Sources whose runs include the bevy_guess ablation (Bevy reading guesses when its disk would idle).
RUNS_GUESS = ("moe-quick", "moe-quick-avx2", "moe-quick-epyc-bf16")


def _guess(src: str) -> tuple[Row, ...]:
    how = SOURCES[src]  # a source that names its schedulers already names bevy_guess
    if "--schedulers" not in how:
        how += " `--schedulers bevy,on_demand,prefetch,bevy_guess`"
    p = "results.bevy_guess.16."
    return (Row("`bevy_guess` (ablation: Bevy's disk reads guessed experts when it would idle) over Bevy",
                f"{_f(src, 'bevy_guess_over_bevy', 'x')} at 16 requests; it read "
                f"{_f(src, p + 'mb_per_token', 'f0')} MB per token, {_f(src, p + 'mb_unused_per_token', 'f0')} "
                f"of them guesses no request used ({_f(src, p + 'guesses_used_frac', 'pct')} of its guessed reads "
                f"were used); tokens equal to on_demand's: "
                f"{_f(src, p + 'same_tokens_as_on_demand', 'pct')}", how),)


# Sources whose runs include the bevy_one_wave ablation (Bevy before its two waves).
RUNS_ONE_WAVE = ("moe-quick",)


def _one_wave(src: str) -> tuple[Row, ...]:
    how = f"{SOURCES[src]} `--schedulers bevy,on_demand,prefetch,bevy_guess,bevy_one_wave`"
    return (Row("Bevy over `bevy_one_wave` (ablation: Bevy's requests always in one wave): what its two waves gain",
                f"{_f(src, 'bevy_over_one_wave', 'x')} at 16 requests; Bevy started "
                f"{_f(src, 'results.bevy.16.two_waves_frac', 'pct')} of its request passes there in two waves, "
                f"{_f(src, 'results.bevy.4.two_waves_frac', 'pct')} at 4 requests", how),)


# Sources whose runs include the bevy_two_waves ablation (Bevy's requests always in two waves).
RUNS_TWO_WAVES = ("moe-quick-avx2", "moe-quick-epyc-bf16")


def _two_waves(src: str) -> tuple[Row, ...]:
    by = "bevy_over_two_waves_by_concurrency."
    return (Row("Bevy over `bevy_two_waves` (ablation: Bevy's requests always in two waves), at 1; 4; 16 "
                "requests: below 1, always two waves would have been faster than its rule's choice",
                "; ".join(_f(src, by + c, "x") for c in CONCURRENCY) + "; Bevy started "
                f"{_f(src, 'results.bevy.16.two_waves_frac', 'pct')} of its request passes in two waves at 16 "
                f"requests, {_f(src, 'results.bevy.4.two_waves_frac', 'pct')} at 4", SOURCES[src]),)


# Sources whose runs include bevy_verify_always (Bevy checking an expert's checksum on every read).
RUNS_VERIFY_ALWAYS = ("moe-quick",)


def _verify_always(src: str) -> tuple[Row, ...]:
    how = f"{SOURCES[src]} `--schedulers bevy,on_demand,prefetch,bevy_guess,bevy_one_wave,bevy_verify_always`"
    p, b = "results.bevy_verify_always.16.", "results.bevy.16."
    return (Row("Bevy (a checksum on an expert's first read and again after its file changed, the default) "
                "over `bevy_verify_always` (a checksum on every read): what checking every read would cost",
                f"{_f(src, 'bevy_over_verify_always', 'x')} at 16 requests; compute per token "
                f"{_f(src, b + 'compute_s_per_token', 'ms')} against the variant's "
                f"{_f(src, p + 'compute_s_per_token', 'ms')}", how),)


# Sources whose runs include Bevy with its matmuls done another way, and that way: bevy_widened
# (every matmul widened to f32) or bevy_native (every matmul in torch's own 16-bit product).
RUNS_COMPUTE_VARIANT = {"moe-quick-avx2": "bevy_native"}
_VARIANT_WHAT = {"bevy_widened": ("every matmul widened to f32", "the 16-bit matmuls", "the exact answers"),
                 "bevy_native": ("every matmul in torch's own bf16 product", "the widening kernels",
                                 "Bevy's are the exact ones")}


def _compute_variant(src: str) -> tuple[Row, ...]:
    how, variant = SOURCES[src], RUNS_COMPUTE_VARIANT[src]
    short = variant.removeprefix("bevy_")
    what, gain, answers = _VARIANT_WHAT[variant]
    by = f"bevy_over_{short}_by_concurrency."
    same = "results.bevy.{c}.same_tokens_as_" + short
    return (Row(f"Bevy (`compute` auto) over `{variant}` ({what}): what {gain} gain, at 1; 4; 16 requests",
                "; ".join(_f(src, by + c, "x") for c in CONCURRENCY), how),
            Row(f"Bevy's tokens equal to `{variant}`'s ({answers}) at 1; 4; 16 requests",
                "; ".join(_f(src, same.format(c=c), "pct") for c in CONCURRENCY), how))


def _ablations(src: str) -> tuple[str, ...]:
    """The ablation schedulers a source's runs include, for its per-scheduler tables."""
    return ((("bevy_guess",) if src in RUNS_GUESS else ()) + (("bevy_one_wave",) if src in RUNS_ONE_WAVE else ())
            + (("bevy_two_waves",) if src in RUNS_TWO_WAVES else ())
            + (("bevy_verify_always",) if src in RUNS_VERIFY_ALWAYS else ())
            + ((RUNS_COMPUTE_VARIANT[src],) if src in RUNS_COMPUTE_VARIANT else ()))


# Sources whose runs record how the matmuls ran and every scheduler's answers (older runs do not).
MEASURES_QUALITY = ("moe-quick", "moe-quick-avx2", "moe-quick-epyc-bf16", "moe-mixtral")


def _quality(src: str) -> tuple[Row, ...]:
    """The quality beside the speedups: how the matmuls ran, and whether Bevy's and prefetch's
    answers are on_demand's (the same requests, greedy)."""
    how = SOURCES[src]

    def f(path: str, fmt: str) -> str:
        return _f(src, path, fmt)

    top = "results.{s}.16.same_tokens_as_on_demand"
    return (
        Row("matmuls (`compute`: the weights' own 16-bit dtype, or widened to f32)", f"{{{src}:compute}}", how),
        Row("tokens equal to on_demand's answers at 16 requests: bevy; prefetch",
            f"{f(top.format(s='bevy'), 'pct')}; {f(top.format(s='prefetch'), 'pct')}", how),
    )


def _result_row(src: str, sched: str, conc: str) -> Row:
    p = f"results.{sched}.{conc}."
    cells = (_f(src, p + "tok_s", "f2"), _f(src, p + "tpot_s", "f2"), _f(src, p + "hit_rate", "f2"),
             _f(src, p + "mb_per_token", "f0"), _f(src, p + "io_busy_frac", "pct"),
             _f(src, p + "compute_frac", "pct"), _f(src, p + "disk_mb_s_busy", "f0"),
             _f(src, p + "cache_budget_mb", "f0"), _f(src, p + "group_max_usage_mb", "f0"))
    return Row(f"{sched}, {conc}", " | ".join(cells), f"`results.{sched}.{conc}`")


# Sources whose runs record the disk's idle time by scheduler phase (disk_idle_*_frac).
MEASURES_IDLE: tuple[str, ...] = ("moe-quick", "moe-quick-avx2", "moe-quick-epyc-bf16", "moe-mixtral")
IDLE_PHASES = ("attention", "experts", "head", "sampling", "scheduling")


def _idle_row(src: str, sched: str) -> Row:
    p = f"results.{sched}.16."
    cells = (_f(src, p + "disk_idle_frac", "pct"),
             *(_f(src, p + f"disk_idle_{ph}_frac", "pct") for ph in IDLE_PHASES))
    return Row(sched, " | ".join(cells), f"`results.{sched}.16.disk_idle_*`")


def _idle(src: str) -> Table:
    return Table(
        f"{src}-idle",
        ("scheduler (16 requests)", "disk idle, share of the wall time", "…while attending a layer and routing",
         "…while computing experts", "…in the LM head", "…sampling", "…scheduling", "JSON field"),  # type: ignore[arg-type]
        tuple(_idle_row(src, s) for s in SCHEDULERS + _ablations(src)))


def _results(src: str) -> Table:
    return Table(
        f"{src}-results",
        ("scheduler, requests", "tok/s (aggregate)", "TPOT per request (s)", "hit rate", "MB read / token",
         "disk busy", "compute thread busy", "disk MB/s while busy", "cache (MB)", "group peak (MB)",
         "JSON field"),  # type: ignore[arg-type]
        tuple(_result_row(src, s, c) for s in SCHEDULERS + _ablations(src) for c in CONCURRENCY))


# Sources whose runs record the stricter bound (compute as on_demand pays it, no read in flight).
MEASURES_STRICT = ("moe-quick-avx2", "moe-quick-epyc-bf16")


def _bound_row(src: str, conc: str) -> Row:
    p = f"overlap_bound.{conc}."
    cells = (_f(src, p + "compute_s_per_token", "ms"), _f(src, p + "io_s_per_token", "ms"),
             _f(src, p + "bound_s_per_token", "ms"), _f(src, p + "bevy_vs_bound", "pct"),
             _f(src, p + "on_demand_vs_bound", "pct"), _f(src, p + "prefetch_vs_bound", "pct"),
             _f(src, p + "max_speedup_vs_on_demand", "x") + f" (I/O: {{{src}:io.effective}})",
             _f(src, p + "max_speedup_vs_prefetch", "x"))
    if src in MEASURES_STRICT:
        cells += (_f(src, p + "compute_without_reads_s_per_token", "ms"), _f(src, p + "bevy_vs_strict_bound", "pct"))
    return Row(conc, " | ".join(cells), f"`overlap_bound.{conc}`")


def _bound(src: str) -> Table:
    # Modelled: a formula over measured parts (engine/bench/moe.py, `overlap_bound`).
    strict = (("compute / token with no read in flight (on_demand's)", "bevy reaches of max(that, I/O)")
              if src in MEASURES_STRICT else ())
    return Table(
        f"{src}-bound",
        ("requests", "compute / token (Bevy's compute time)", "I/O / token (Bevy's bytes ÷ disk)",
         "bound = max(compute, I/O)", "bevy reaches", "on_demand reaches", "prefetch reaches",
         "most any scheduler can gain over on_demand", "over prefetch", *strict, "JSON field"),  # type: ignore[arg-type]
        tuple(_bound_row(src, c) for c in CONCURRENCY))


# Sources whose runs record the engine process's CPU time and page faults (cpu_s_per_token, ...).
MEASURES_CPU = ("moe-quick-epyc-bf16",)


def _per_scheduler(src: str, name: str, columns: tuple[str, ...], fields: tuple[tuple[str, str], ...],
                   how: str) -> Table:
    """A table of figures at 16 requests, a row per scheduler: `fields` are (results key, format)."""
    def row(sched: str) -> Row:
        cells = (_f(src, f"results.{sched}.16.{key}", fmt) for key, fmt in fields)
        return Row(sched, " | ".join(cells), how.format(sched=sched))

    return Table(f"{src}-{name}", ("scheduler (16 requests)", *columns, "JSON field"),  # type: ignore[arg-type]
                 tuple(row(s) for s in SCHEDULERS + _ablations(src)))


def _cpu(src: str) -> Table:
    return _per_scheduler(
        src, "cpu", ("scheduler thread computing / token", "CPU time / token (every thread)",
                     "…of it the OS's (system time)", "page faults that read a file / token",
                     "cyclic GC's pauses / token"),
        (("compute_s_per_token", "ms"), ("cpu_s_per_token", "ms"), ("cpu_sys_s_per_token", "ms"),
         ("major_faults_per_token", "f2"), ("gc_s_per_token", "ms")),
        "`results.{sched}.16.cpu_*`, `gc_s_per_token`")


def _phases(src: str) -> Table:
    return _per_scheduler(
        src, "phases", ("scheduler thread computing / token", "…attending a layer and routing",
                        "…computing experts", "…in the LM head"),
        (("compute_s_per_token", "ms"), ("attention_s_per_token", "ms"), ("experts_s_per_token", "ms"),
         ("head_s_per_token", "ms")),
        "`results.{sched}.16.*_s_per_token`")


FILE = REPO_ROOT / "docs" / "moe.md"
TABLES = tuple(t for src in SOURCES for t in (_headline(src), _results(src), _bound(src),
                                               *((_idle(src),) if src in MEASURES_IDLE else ()),
                                               *((_cpu(src), _phases(src)) if src in MEASURES_CPU else ())))
