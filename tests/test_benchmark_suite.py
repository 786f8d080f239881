"""The benchmark suite (benchmarks/suite.py): a --quick smoke run yields a table with every case row.

The full run (minutes, on a quiet machine) is not a test; the smoke run only checks that every case
runs, reports and lands in the table. Lightning is optional: its rows must say it was skipped when it
is absent, which `DREAM_BENCH_NO_LIGHTNING=1` simulates.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from helpers import run_python_forked

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SKIP = "skipped: lightning not installed"


@pytest.fixture(scope="module")
def suite():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("suite")


def _lightning_installed() -> bool:
    return importlib.util.find_spec("lightning") is not None


def _rows(result, benchmark_prefix: str) -> dict[str, dict]:
    return {r["case"]: r for r in result["rows"] if r["benchmark"].startswith(benchmark_prefix)}


def _assert_measured(row: dict) -> None:
    assert row["median"], row
    assert row["vs_baseline"], row
    assert not row["result"].startswith(("error", "skipped")), row
    if row["target"]:
        assert row["result"] in ("PASS", "MISS"), row


def _assert_lightning_rows(rows: dict[str, dict], labels: list[str], lightning: bool) -> None:
    for label in labels:
        if lightning:
            _assert_measured(rows[label])
        else:
            assert rows[label]["result"] == SKIP, rows[label]
            assert rows[label]["median"] == "", rows[label]


def _run_child_forked(suite, run_child, argv, timeout=None) -> dict:
    """`run_child(argv)` (the suite's own), the benchmark script forked from a process that already imported torch
    (`helpers.run_python_forked`): the smoke run checks what each case reports, not its timings, and ~10
    fresh torch imports cost a quarter of it. The import-time cases (`python -c ...`, `python -X ...`)
    still start fresh interpreters: an import is what they time."""
    argv = [str(a) for a in argv]
    if argv[0] != sys.executable or argv[1].startswith("-"):
        return run_child(argv, timeout)
    proc = run_python_forked(*argv[1:], env=suite.child_env(), cwd=suite.REPO, timeout=timeout or 600)
    return suite.child_result(argv, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def quick_run(suite, tmp_path_factory):
    """`benchmarks/suite.py --quick --out RESULTS.md` with Lightning as installed, once per test run (its
    tests form one xdist group): its result, the report file, and every benchmark process it ran as
    `(argv, the dict it returned)`, the process's output in `_stdout`."""
    children: list[tuple[tuple[str, ...], dict]] = []
    run_child = suite.run_child

    def recording(argv, timeout=None):
        result = _run_child_forked(suite, run_child, argv, timeout)
        children.append((tuple(str(a) for a in argv), copy.deepcopy(result)))
        return result

    out = tmp_path_factory.mktemp("quick") / "RESULTS.md"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(suite.NO_LIGHTNING_ENV, raising=False)
        mp.setattr(suite, "run_child", recording)
        result = suite.main(["--quick", "--out", str(out)])
    return result, out, children


@pytest.mark.slow  # some 25 fresh Python + torch processes: 1-4 minutes on 2 cores
def test_quick_suite_reports_every_case(suite, quick_run):
    result, out, children = quick_run
    lightning = _lightning_installed()
    assert result["errors"] == {}, result["errors"]
    assert result["exit_code"] == 0  # MISSes (meaningless in a quick run) do not fail it
    assert result["sections"] == list(suite.SECTIONS)
    assert (result["lightning"] is not None) == lightning

    tiny = suite.load_module("tiny_mlp")
    for prefix in ("tiny MLP (", "tiny MLP, peak RSS"):
        rows = _rows(result, prefix)
        assert set(rows) == {tiny.LABELS[c] for c in tiny.CASES}, rows
        for case in ("plain", "dream", "dream_defaults"):
            _assert_measured(rows[tiny.LABELS[case]])
        _assert_lightning_rows(rows, [tiny.LABELS[c] for c in tiny.LIGHTNING_CASES], lightning)

    lm = suite.load_module("transformer")
    rows = _rows(result, "transformer LM")
    assert set(rows) == set(lm.LABELS.values())
    _assert_measured(rows[lm.LABELS["plain"]])
    _assert_measured(rows[lm.LABELS["dream"]])
    _assert_lightning_rows(rows, [lm.LABELS["lightning"]], lightning)

    rows = _rows(result, "2-rank DDP")
    assert len(rows) == 4, rows
    if (BENCH / "ddp.py").exists():
        for row in rows.values():
            _assert_measured(row)
        # `python benchmarks/ddp.py --quick` (its main(), run here in a fresh process: two torchrun launches
        # of 2 processes each) printed its own table too; tests/test_distributed.py relies on this check.
        (printed,) = [r["_stdout"] for argv, r in children if "--call" in argv and argv[-2:] == ("--", "--quick")
                      and Path(argv[argv.index("--call") + 1]).name == "ddp.py"]  # fmt: skip
        table = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in printed.splitlines() if line[:2] == "| "}
        assert {"plain", "dream", "dream/plain"} <= set(table), printed
        assert all(float(cell.strip().rstrip("x")) > 0 for cell in table["dream/plain"]), printed
    else:
        assert all(r["result"].startswith("skipped") for r in rows.values()), rows

    rows = _rows(result, "checkpoint")
    assert {"torch.save(state)", "trainer.load_checkpoint", "async save_checkpoint: caller blocked"} <= set(rows)
    for label in ("trainer.save_checkpoint (+ fsync, atomic rename)", "trainer.load_checkpoint"):
        _assert_measured(rows[label])

    rows = _rows(result, "import time")
    assert {"import torch", "import dream_trainer", "import lightning.pytorch"} < set(rows)
    assert any(case.startswith("import torch.utils.tensorboard") for case in rows), rows
    _assert_measured(rows["import dream_trainer"])
    _assert_lightning_rows(rows, ["import lightning.pytorch"], lightning)

    text = out.read_text()
    assert text == result["markdown"]
    assert "| benchmark | case | median | vs baseline | target | result |" in text
    assert "python benchmarks/suite.py --quick --out" in text
    assert re.search(r"^- commit: [0-9a-f]{7,}", text, re.M), text[:600]  # a report names what it measured
    assert "torch 2." in text and "CPU cores" in text
    assert ("lightning " + result["lightning"]) in text if lightning else "lightning absent" in text


@pytest.mark.slow  # the benchmark processes are quick_run's (see below)
def test_quick_suite_without_lightning_says_skipped(suite, quick_run, monkeypatch):
    if not _lightning_installed():
        pytest.skip("lightning is absent: the main smoke test already checks the skipped rows")
    # This run's benchmark processes are quick_run's non-Lightning ones, with the same command lines; a
    # process reads nothing that DREAM_BENCH_NO_LIGHTNING changes (only the suite and the scripts' own
    # main() ask lightning_version()), so their results are reused instead of measured a second time.
    # What this test checks is the suite's side: which cases it runs, skips and reports. A command line
    # quick_run did not run is run for real.
    done = {argv: result for argv, result in quick_run[2]}
    run_child, reused = suite.run_child, []

    def reuse(argv, timeout=None):
        key = tuple(str(a) for a in argv)
        if key in done:
            reused.append(key)
            return copy.deepcopy(done[key])
        return run_child(argv, timeout)

    monkeypatch.setattr(suite, "run_child", reuse)
    monkeypatch.setenv(suite.NO_LIGHTNING_ENV, "1")
    result = suite.main(["--quick", "--only", "tiny,transformer,import"])
    assert reused, "no benchmark process of this run has quick_run's command line"
    assert result["errors"] == {}, result["errors"]
    assert result["lightning"] is None
    skipped = [r for r in result["rows"] if r["result"] == SKIP]
    # tiny: 2 time + 2 RSS rows, transformer: 1, import: 1; nothing else skipped, nothing Lightning measured.
    assert len(skipped) == 6, skipped
    assert all("Lightning" in r["case"] or "lightning" in r["case"] for r in skipped)
    assert f"lightning absent ({suite.NO_LIGHTNING_ENV}=1)" in result["markdown"]
    assert "install the `bench` extra" in result["markdown"]
    for r in result["rows"]:
        if r["result"] != SKIP:
            _assert_measured(r)


def test_lightning_version_honours_env(suite, monkeypatch):
    monkeypatch.setenv(suite.NO_LIGHTNING_ENV, "1")
    assert suite.lightning_version() is None
    monkeypatch.delenv(suite.NO_LIGHTNING_ENV)
    assert (suite.lightning_version() is not None) == _lightning_installed()


def test_only_parses_names_and_aliases(suite):
    assert suite.parse_only(None) == list(suite.SECTIONS)
    assert suite.parse_only("import, rss,tiny") == ["tiny", "import"]  # suite order, no duplicates
    with pytest.raises(SystemExit, match="unknown case 'nope'"):
        suite.parse_only("tiny,nope")


def test_missing_ddp_script_is_reported_as_skipped(suite, tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "HERE", tmp_path)  # a benchmarks/ without ddp.py
    rows, raw = suite.section_ddp(argparse.Namespace(quick=True, rounds=None), None)
    assert raw == {}
    assert len(rows) == 4
    assert all(r.result == "skipped: benchmarks/ddp.py not found" for r in rows)


def test_table_marks_pass_and_miss(suite):
    assert suite.check(1.04, 1.05) == "PASS"
    assert suite.check(1.06, 1.05) == "MISS"
    table = suite.markdown_table([suite.Row("b", "c", "1.0 s", "1.02x", "<= 1.05x", "PASS")])
    assert table.splitlines()[-1] == "| b | c | 1.0 s | 1.02x | <= 1.05x | PASS |"


def test_step_overhead_smoke_run_reports_both_cases():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    step_overhead = importlib.import_module("step_overhead")
    result = step_overhead.main(["--rounds", "1", "--steps", "20"])
    for case in ("plain", "dream"):
        assert 0 < result[f"{case}_min_us"] <= result[f"{case}_median_us"]
    assert result["overhead_min_us"] == pytest.approx(result["dream_min_us"] - result["plain_min_us"])
