"""The suite's own check (tests/process_check.py): a process a test leaves running fails the run, named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO

LEAKY = """
import subprocess, sys

def test_leaves_a_sleeper():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # LEFT-BEHIND"])
"""


def test_a_process_that_outlives_its_test_fails_the_run_and_is_ended(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "tests"),
        "DREAM_TRAINER_TEST_PROCESS_GRACE": "1",
        "PYTEST_ADDOPTS": "",
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "process_check", "-p", "no:cacheprovider", "-n", "0",
         "-o", "addopts=", "test_leaky.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 passed" in run.stdout  # the test itself passed: the run failed for the process it left
    assert "1 process(es) the test run started outlived it (now killed)" in run.stdout
    assert "LEFT-BEHIND" in run.stdout
    left = subprocess.run(["pgrep", "-f", "LEFT-BEHIND"], capture_output=True, text=True).stdout.split()
    assert [pid for pid in left if int(pid) != os.getpid()] == []  # ended by the check
