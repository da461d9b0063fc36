"""docs/reliability.md's figure table: the quick chaos runs (see engine/bench/_figures/__init__.py for the rules).

Only the chaos benchmark measures recovery; the reliability tests assert bounds
(named in the doc's prose), they write no figures.
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

HOW = "`flotilla bench chaos --quick`"
C = "chaos-quick"

CHAOS = Table("reliability-chaos", ("what", "figure", "how"), (
    Row("requests sent by the 16 clients",
        f"{{{C}:submitted|int}} submitted: {{{C}:completed|int}} completed, {{{C}:failed|int}} failed, "
        f"{{{C}:unfinished|int}} unfinished", HOW),
    Row("completed answers identical to the uninterrupted run",
        f"{{{C}:identical|int}} ({{{C}:usage_mismatches|int}} with a wrong usage count)", HOW),
    Row("tokens duplicated / lost / replaced",
        f"{{{C}:duplicated_tokens|int}} / {{{C}:lost_tokens|int}} / {{{C}:mismatched_tokens|int}}", HOW),
    Row("stage kills (SIGKILL) / successful recoveries / kills not recovered",
        f"{{{C}:kills|int}} / {{{C}:recoveries|int}} / {{{C}:unrecovered_kills|int}}", HOW),
    Row("recovery: kill → every running stream had its next token",
        f"worst of a run {{{C}:max_recovery_s|f1}} s (goal < {{{C}:recovery_goal_s|f0}} s), "
        f"median of a run {{{C}:median_recovery_s|f1}} s", HOW),
    Row("the first recovery of a run, in parts",
        f"detection {{{C}:detect_s.0|f2}} s; re-plan {{{C}:recovery_records.0.replan_s|f2}} s, "
        f"re-wire {{{C}:recovery_records.0.rewire_s|f2}} s, detection → resumed "
        f"{{{C}:recovery_records.0.resume_s|f2}} s ({{{C}:recovery_records.0.streams|int}} streams, "
        f"{{{C}:recovery_records.0.replayed_tokens|int}} tokens replayed)", HOW),
    Row("worker RSS growth (the largest of one worker)", f"{{{C}:worker_rss_growth_mb|f1}} MiB", HOW),
    Row("run met the goal (`passed`)", f"{{{C}:passed}}", HOW),
))

FILE = REPO_ROOT / "docs" / "reliability.md"
TABLES = (CHAOS,)
