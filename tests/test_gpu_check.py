"""benchmarks/gpu_check.py, the one command a GPU machine runs for its evidence: its CPU fallback runs every
check here and reports each in the markdown section it writes; its parts (device choice, budget, JUnit
counts) without processes.

The GPU side itself cannot run here: the fallback goes through the same checks, processes and report,
so the first run on a GPU meets only what differs there (CUDA, NCCL, inductor)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, launcher_free_env, python
from test_project_text import first_table_label_problems

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    bench = str(SCRIPT.parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("gpu_check")


def _rows(text: str) -> dict[str, list[str]]:
    """The report's table: check title -> [result, seconds, figures]."""
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    return {cells[0][2:]: [c.strip(" |") for c in cells[1:]] for cells in rows}


@pytest.mark.slow  # 9 Python + torch processes (two of them pytest; forked from the zygote), 2 at a time
def test_cpu_fallback_runs_every_check_and_reports_each(gpu_check, tmp_path):
    out = tmp_path / "gpu.md"
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    argv = ["--device", "cpu", "--quick", "--jobs", "2", "--budget", "240", "--out", str(out)]
    # From another directory: the script finds the repository (and its tests) from its own path.
    proc = subprocess.run(
        [python(), str(SCRIPT), *argv], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    text = out.read_text()
    assert proc.stdout.splitlines()[0] == "--device cpu: the CPU fallback (reduced checks, not GPU evidence)"
    assert text in proc.stdout  # printed as written

    assert text.startswith("## GPU check, CPU fallback (")
    assert re.search(r"^- date: \d{4}-\d\d-\d\d \d\d:\d\d UTC", text, re.M), text
    assert re.search(r"^- commit: [0-9a-f]{7,}", text, re.M), text
    assert re.search(r"^- machine: CPU only, --device cpu: the CPU fallback .*CPU cores.*; torch 2\.", text, re.M)
    assert f"- command: `python benchmarks/gpu_check.py {' '.join(argv)}`" in text

    rows = _rows(text)
    assert list(rows) == [gpu_check.TITLES[name] for name in gpu_check.CHECKS], text
    assert all(result == "ok" and float(seconds) > 0 for result, seconds, _ in rows.values()), text
    assert "6 ok, 0 failed, 0 skipped" in text
    figures = {title: cells[2] for title, cells in rows.items()}
    # Without CUDA the CUDA-only tests are found and run, and skip.
    found = r"0 passed, 0 failed, [1-9]\d* skipped of \d+: .*test_metrics_live_on_cuda"
    assert re.search(found, figures["CUDA-only tests"]), figures["CUDA-only tests"]
    assert "step dtype bfloat16; weights float32 on cpu" in figures["bf16 autocast"]
    assert "step dtype float16" in figures["fp16 autocast + GradScaler"]
    assert "GradScaler: scale" in figures["fp16 autocast + GradScaler"]
    assert "OptimizedModule: yes" in figures["compile_model"]
    ddp = figures["DDP / process group"]
    assert "ddp: strategy 'ddp'" in ddp and "fsdp: strategy 'fsdp'" in ddp and "group backend gloo" in ddp
    assert "all_reduce of a cpu tensor (gloo): ok" in ddp
    assert re.search(r"tokens/s dream/plain \d+\.\d{3}x", figures["transformer vs plain loop"])
    assert re.search(r"peak RSS dream/plain \d+\.\d{3}x", figures["transformer vs plain loop"])
    for title in ("bf16 autocast", "fp16 autocast + GradScaler", "compile_model"):
        first, last = map(float, re.search(r"loss (\S+) -> (\S+) \(", figures[title]).groups())
        assert last < 0.8 * first, figures[title]


def test_an_exhausted_budget_skips_each_check_with_a_line(gpu_check, tmp_path):
    # --device cpu starts no probe and a check that cannot start starts no process: nothing runs here.
    out = tmp_path / "gpu.md"
    result = gpu_check.main(["--device", "cpu", "--budget", "0", "--out", str(out), "--skip", "ddp"])
    assert result["exit_code"] == 0
    statuses = {r["name"]: (r["status"], r["figures"]) for r in result["results"]}
    assert statuses["ddp"] == ("skipped", "--skip")
    for name in set(gpu_check.CHECKS) - {"ddp"}:
        assert statuses[name][0] == "skipped"
        assert statuses[name][1].startswith("skipped: 0 s of the budget left"), statuses[name]
        assert f"- {gpu_check.TITLES[name]}: skipped: 0 s of the budget left" in out.read_text()
    assert "0 ok, 0 failed, 6 skipped" in result["markdown"]
    # Pasted into benchmarks/RESULTS.md, it carries the labels of the file's sections.
    assert first_table_label_problems(result["markdown"]) == []


def test_budget_plan_shrinks_then_skips(gpu_check):
    assert gpu_check.plan_check(500, 120, 20) == (120, 1.0)  # enough left: the check's own limit
    assert gpu_check.plan_check(60, 120, 20) == (60, 0.5)  # less: what is left, steps scaled
    assert gpu_check.plan_check(10, 120, 5) == (10, 0.25)  # never below a quarter of the steps
    assert gpu_check.plan_check(19, 120, 20) == (None, 0.0)  # under its least: skipped


def test_device_choice_falls_back_to_the_cpu_and_says_so(gpu_check):
    assert gpu_check.choose_device("auto", {"cuda": True}) == ("cuda", None)
    device, line = gpu_check.choose_device("auto", {"cuda": False})
    assert device == "cpu" and "CPU fallback" in line
    device, line = gpu_check.choose_device("cpu", {"cuda": True})
    assert device == "cpu" and "CPU fallback" in line
    with pytest.raises(ValueError, match=r"--device cuda: torch 2\.x sees no CUDA device"):
        gpu_check.choose_device("cuda", {"cuda": False, "torch": "2.x"})
    with pytest.raises(ValueError, match="unknown check"):
        gpu_check.parse_skip("bf16,nope")


def test_junit_counts_and_names(gpu_check, tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2&#10;more">tb</failure>'
        "</testcase>"
        '<testcase classname="tests.test_b" name="test_err"><error message="fixture broke"/></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = gpu_check.parse_junit(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 2, 1)
    assert counts["failures"] == ["tests.test_a::test_bad: assert 1 == 2", "tests.test_b::test_err: fixture broke"]
    assert counts["skips"] == ["tests.test_b::test_skip: needs CUDA"]


def test_candidate_files_hold_the_cuda_only_tests(gpu_check):
    files = gpu_check.candidate_test_files()
    assert "tests/test_torchmetrics.py" in files
    assert "tests/test_gpu_check.py" in files  # it mentions CUDA; it has no CUDA-only test, which is fine
    assert "tests/test_loop.py" not in files


def test_a_hung_check_is_killed_with_its_children_at_its_limit(gpu_check, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = gpu_check.run_proc([sys.executable, "-c", code], timeout=5)
    assert proc.timed_out and proc.why() == f"timed out after {proc.seconds:.0f} s"
    assert proc.seconds < 30
    assert pid_file.exists(), "the child did not start its own child within 5 s"
    status = Path(f"/proc/{pid_file.read_text()}/status")

    def gone() -> bool:  # or a zombie nobody has reaped yet
        try:
            return "\nState:\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10  # SIGKILL to the group is delivered, not awaited
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


def test_a_crashing_check_fails_alone(gpu_check, monkeypatch, tmp_path):
    def crash(ctx, timeout):
        raise RuntimeError("boom")

    def fine(ctx, timeout):
        return gpu_check.CheckResult("fp16", "ok", 1.0, f"scale {ctx.scale}")

    monkeypatch.setattr(gpu_check, "CHECK_FUNCS", {"bf16": crash, "fp16": fine})
    notes: list[str] = []

    def make_ctx(scale, tmp):
        return gpu_check.Context("cpu", {}, {}, scale, "inductor", 1, 1, tmp)

    results = gpu_check.run_checks(["bf16", "fp16"], [], time.perf_counter() + 100, 1, make_ctx, notes)
    assert [(r.name, r.status) for r in results] == [("bf16", "failed"), ("fp16", "ok")]
    assert results[0].figures == "RuntimeError: boom"
    assert results[1].figures == "scale 1.0"
