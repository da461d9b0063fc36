"""`flotilla bench report` and the provenance every bench JSON carries.

The README's and docs' figure tables are generated from docs/bench/*.json; the
suite fails when a table is stale or a figure has no source.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import pytest

from engine.bench import _figures, _provenance, _report
from engine.cli import bench_cmd


def _fake_module(figures: dict) -> types.ModuleType:
    m = types.ModuleType("fake_bench")
    m.NAME = "fake"
    m.run = lambda args, report: dict(figures)
    return m


def _provenance_block(dirty: bool = False) -> dict:
    block = _provenance.finish(_provenance.collect_before())
    return {**block, "dirty": dirty, "dirty_paths": ["engine/x.py"] if dirty else []}


def test_bench_json_records_commit_cpu_flags_load_and_io(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = bench_cmd.cmd_bench(_fake_module({"x": 1.5}), argparse.Namespace(quick=True, json=out, runs=1, out_dir=None))
    data = json.loads(out.read_text())
    assert rc == 0 and data["x"] == 1.5 and data["scenario"] == "fake"
    prov = data["provenance"]
    assert _provenance.missing_fields(prov) == []
    assert len(prov["commit"]) == 40 and isinstance(prov["dirty"], bool)
    assert all(p.startswith(_provenance.CODE_PATHS) for p in prov["dirty_paths"])
    cpu = prov["cpu"]
    assert cpu["model"] and cpu["cores"] >= 1 and isinstance(cpu["flags"], list)
    assert set(cpu["flags"]) <= set(_provenance.RELEVANT_FLAGS)
    # the precision OpenVINO computes in by default, as a plain name (bf16 on AMX, f32 on AVX2-only)
    assert cpu["openvino_cpu"]["default_precision"] in ("bf16", "f16", "f32")
    assert len(prov["load_before"]) == 3 and len(prov["load_after"]) == 3
    assert data["io"]["effective"].startswith("none")  # the scenario measured no storage reads
    assert not list(tmp_path.glob("*.tmp"))


def test_a_scenario_that_failed_its_goal_exits_nonzero_after_writing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    module = _fake_module({"passed": False, "failures": ["max recovery 6.4 s > goal 5 s"]})
    assert bench_cmd.cmd_bench(module, argparse.Namespace(quick=True, json=out, runs=1, out_dir=None)) == 1
    assert json.loads(out.read_text())["passed"] is False
    assert "max recovery 6.4 s" in capsys.readouterr().err


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    info = _provenance.cpu_info("model name\t: Some CPU\nflags\t\t: fpu avx2 fma amx_bf16 sse\n")
    assert info["model"] == "Some CPU" and info["flags"] == ["amx_bf16", "avx2", "fma"]


def test_values_render_as_median_with_min_max() -> None:
    assert _report.render_value([1.0, 3.0, 2.0], "f1") == "2.0 (1.0–3.0)"
    assert _report.render_value([1.38, 1.38, 1.38], "x") == "1.38×"
    assert _report.render_value([0.015, 0.02, 0.01], "pct") == "1.5 % (1.0–2.0)"
    assert _report.render_value([True, True], "g") == "yes"
    assert _report.render_value([True, False, True], "g") == "2 of 3 runs"
    assert _report.render_value([0.0123], "ms") == "12.3 ms"
    assert _report.render_value([-0.07, -0.044, -0.02], "pct") == "-4.4 % (-7.0 to -2.0)"


def _write_runs(folder: Path, values: list[float], provenance: bool = True, dirty: bool = False) -> None:
    folder.mkdir(parents=True)
    for i, v in enumerate(values):
        data = {"scenario": "s", "a": {"b": v}}
        if provenance:
            data["provenance"] = _provenance_block(dirty)
        (folder / f"run-{i + 1}.json").write_text(json.dumps(data))


def _table(figure: str) -> _report.Table:
    return _report.Table("t", ("what", "figure", "how"), (_report.Row("thing", figure, "cmd"),))


def test_a_table_is_rendered_from_the_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_report, "BENCH_DIR", tmp_path)
    _write_runs(tmp_path / "s-quick", [1.0, 2.0, 4.0])
    text = _report.render_table(_table("{s-quick:a.b|f1} tok/s"))
    assert "| thing | 2.0 (1.0–4.0) tok/s | cmd |" in text
    assert "3 runs" in text and "commit" in text  # the footnote names the sources


@pytest.mark.parametrize("case, needle", [
    ("no_source", "no JSON"),
    ("no_field", "field 'a.c' is missing"),
    ("no_provenance", "no provenance"),
    ("no_placeholder", "a figure with no source"),
    ("dirty", "measured uncommitted code (engine/x.py)"),
])
def test_a_figure_without_a_source_fails_naming_its_row(tmp_path: Path, monkeypatch, case: str, needle: str) -> None:
    monkeypatch.setattr(_report, "BENCH_DIR", tmp_path)
    if case != "no_source":
        _write_runs(tmp_path / "s-quick", [1.0], provenance=case != "no_provenance", dirty=case == "dirty")
    figure = {"no_field": "{s-quick:a.c}", "no_placeholder": "1.38× (typed by hand)"}.get(case, "{s-quick:a.b}")
    with pytest.raises(_report.ReportError, match="row 'thing'") as e:
        _report.render_table(_table(figure))
    assert needle in str(e.value)


def test_report_check_fails_on_a_stale_table_and_rewrites_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_report, "BENCH_DIR", tmp_path)
    _write_runs(tmp_path / "s-quick", [5.0])
    md = tmp_path / "doc.md"
    md.write_text("intro\n<!-- bench-report:t start -->\n| hand | 9.9 | x |\n<!-- bench-report:t end -->\nend\n")
    files = {md: (_table("{s-quick:a.b|f1}"),)}
    assert _report.run_report(files, check=True) == [str(md)]
    assert "9.9" in md.read_text()  # --check never writes
    _report.run_report(files, check=False)
    assert "| thing | 5.0 | cmd |" in md.read_text() and md.read_text().endswith("end\n")
    assert _report.run_report(files, check=True) == []


def test_readme_and_docs_tables_are_generated_from_committed_jsons() -> None:
    """The committed tables equal what the committed JSONs give: no figure typed by hand."""
    stale = _report.run_report(_figures.files(), check=True)
    assert stale == [], f"stale figure tables in {stale}: run `flotilla bench report`"


def test_runs_go_to_one_folder_replacing_older_runs(tmp_path: Path) -> None:
    folder = tmp_path / "fake-quick"
    folder.mkdir()
    (folder / "run-7.json").write_text("{}")  # from an earlier, longer series
    args = argparse.Namespace(quick=True, json=None, runs=3, out_dir=folder)
    assert bench_cmd.cmd_bench(_fake_module({"x": 2.0}), args) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["run-1.json", "run-2.json", "run-3.json"]
    assert all(json.loads(p.read_text())["x"] == 2.0 for p in folder.iterdir())


def test_fields_are_found_by_dotted_paths_and_keys_with_dots() -> None:
    data = {"a": {"0.85": {"x": [3, 4]}, "b": 1}}
    assert _report.field(data, "a.0.85.x.1") == 4 and _report.field(data, "a.b") == 1
    with pytest.raises(KeyError):
        _report.field(data, "a.0.5.x")


def test_provenance_is_read_once_per_process() -> None:
    assert _provenance.git_commit() is _provenance.git_commit()
