"""`flotilla bench grammar` at a tiny size: every figure is there and consistent.
No speed assertions: the real figures come from running the benchmark."""

from __future__ import annotations

import argparse
import json

from engine.bench import grammar


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    grammar.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def test_grammar_bench_reports_every_cell(demo_dir):
    demo_dir("demo")
    lines: list[str] = []
    out = grammar.run(_args(["--tokens", "30", "--vocab", "3000", "--rounds", "1"]), lines.append)
    json.dumps(out, allow_nan=False)
    assert set(out["cells"]) == {"demo", "stdlib_bpe"}
    assert out["setup"]["stdlib_bpe_vocab"] == out["cells"]["stdlib_bpe"]["any_object"]["llguidance"]["vocab_size"]
    for vocab in out["cells"].values():
        assert set(vocab) == set(grammar.SCHEMAS)
        for libs in vocab.values():
            assert "llguidance" in libs and set(libs) <= {"llguidance", "xgrammar"}
            for cell in libs.values():
                assert cell["mask_ms"]["n"] == 30 and 0 < cell["mask_ms"]["min"] <= cell["mask_ms"]["median"]
                assert cell["mask_ms"]["median"] <= cell["mask_ms"]["p95"] <= cell["mask_ms"]["max"]
                assert cell["compile_ms"] > 0 and cell["first_request_ms"] > 0
    # bounded schemas end: 30 picks complete at least one tool-arguments answer
    assert out["cells"]["demo"]["tool_arguments"]["llguidance"]["answers_completed"] >= 1
    (row,) = out["engine"]["rounds"]
    assert row["tokens"] == row["free_tokens"] > 100  # 60 digits and their commas: the same length both ways
    assert out["engine"]["ms_per_token_ratio"]["median"] == round(
        row["constrained_ms_per_token"] / row["free_ms_per_token"], 3)
