"""benchmarks/model_parallel.py: a --quick smoke run (4 torchrun processes on gloo, dp_shard=2 x
tensor_parallel=2) trains the plain FSDP2 + TP loop and the DreamTrainer case, reports the table, and
both end at the same loss and weights (the script exits non-zero when they do not)."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import REPO, launcher_free_env, python

BENCHMARK = REPO / "benchmarks" / "model_parallel.py"


@pytest.mark.slow
def test_model_parallel_benchmark_quick() -> None:
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([python(), str(BENCHMARK), "--quick"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in proc.stdout.splitlines() if line[:2] == "| "}
    assert {"plain", "dream", "dream/plain"} <= set(rows), proc.stdout
    assert all(float(cell.strip().rstrip("x")) > 0 for cell in rows["dream/plain"]), proc.stdout
    assert "every run agrees" in proc.stdout, proc.stdout
