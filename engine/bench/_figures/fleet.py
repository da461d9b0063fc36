"""docs/fleet.md's figure tables: what CURVE costs on the data plane (see engine/bench/_figures/__init__.py).

The fleet's other timings (mDNS discovery, yield, the demo) are bounds asserted by
tests, stated in the prose with the test's name; no benchmark JSON carries them.
"""

from __future__ import annotations

from engine.bench._report import REPO_ROOT, Row, Table

PIPE = "`flotilla bench pipeline --quick`"

FLEET_CURVE = Table("fleet-curve", ("what", "figure", "how"), (
    Row("one decode hop on loopback: round trip of a step frame (header + hidden 1024 f32), DEALER → ROUTER → back",
        "{pipeline-quick:curve_hop_us.plaintext|f0} µs plaintext, {pipeline-quick:curve_hop_us.curve|f0} µs CURVE, "
        "added {pipeline-quick:curve_hop_us.added_per_round_trip|f0} µs ({pipeline-quick:curve_hop_us.frame_bytes|int} "
        "bytes a frame)", PIPE + " (`curve_hop_us`, median of 2000 round trips)"),
    Row("2-stage ring, aggregate tok/s, plaintext vs CURVE, 1 stream",
        "{pipeline-quick:curve_aggregate_tok_s.plaintext.1|f1} vs {pipeline-quick:curve_aggregate_tok_s.curve.1|f1}",
        PIPE + " (`curve_aggregate_tok_s`)"),
    Row("the same, 2 streams",
        "{pipeline-quick:curve_aggregate_tok_s.plaintext.2|f1} vs {pipeline-quick:curve_aggregate_tok_s.curve.2|f1}",
        PIPE),
    Row("`curve_overhead`: 1 − CURVE / plaintext, median of back-to-back pairs, 2 streams (goal < 3 %)",
        "{pipeline-quick:curve_overhead|pct}", PIPE),
    Row("1 − CURVE / plaintext from the medians, 1 / 2 streams (`curve_overhead_by_streams`)",
        "{pipeline-quick:curve_overhead_by_streams.1|pct} / {pipeline-quick:curve_overhead_by_streams.2|pct}", PIPE),
))

FLEET_CURVE_MODELLED = Table("fleet-curve-modelled", ("what", "modelled figure", "model"), (
    Row("CURVE's share of a token's time (`curve_overhead_model`)",
        "{pipeline-quick:curve_overhead_model|pct} of throughput",
        "(stages + 1) hops × half the added round trip / the plaintext ring's time per token at 1 stream "
        "(`engine/bench/_curve.py`)"),
))

FILE = REPO_ROOT / "docs" / "fleet.md"
TABLES = (FLEET_CURVE, FLEET_CURVE_MODELLED)
