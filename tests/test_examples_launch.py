"""An example that needs torchrun, started with plain `python`, says in one line how to launch it and
exits with status 2 (argparse's status for a command used wrongly), instead of a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import EXAMPLES, REPO, launcher_free_env, load_example, run_python_forked

pytestmark = pytest.mark.usefixtures("restore_torch_threads")  # main() sets the thread count


def test_gpt_2d_with_plain_python_prints_the_torchrun_command(tmp_path: Path) -> None:
    # Run as the docs say, from the repository root; --root-dir keeps any run out of the checkout.
    runs = tmp_path / "runs"
    result = run_python_forked(
        "examples/gpt_2d.py", "--max-steps", "5", "--root-dir", runs, cwd=REPO, env=launcher_free_env(), timeout=120
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "gpt_2d.py needs 4 processes: torchrun --standalone --nproc_per_node 4 examples/gpt_2d.py "
        f"--max-steps 5 --root-dir {runs}"
    ]
    assert not runs.exists()  # nothing started


@pytest.mark.parametrize(
    ("argv", "n"),
    [([], 4), (["--tp", "2", "--pp", "2"], 4), (["--dp-replicate", "2"], 4), (["--tp", "1", "--dp-shard", "2"], 2)],
)
def test_gpt_2d_hint_names_the_processes_its_flags_need(
    argv: list[str], n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpt_2d = load_example("gpt_2d")
    monkeypatch.chdir(REPO)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    flags = "".join(f" {a}" for a in argv)
    expected = f"gpt_2d.py needs {n} processes: torchrun --standalone --nproc_per_node {n} examples/gpt_2d.py{flags}"
    assert gpt_2d.launch_hint(gpt_2d.parse_args(argv), argv) == expected


def test_gpt_2d_runs_on_one_process_with_tp_1_and_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    gpt_2d = load_example("gpt_2d")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert gpt_2d.launch_hint(gpt_2d.parse_args(["--tp", "1"]), ["--tp", "1"]) is None
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's: the trainer checks the degrees against it
    assert gpt_2d.launch_hint(gpt_2d.parse_args([]), []) is None
    first_command = (EXAMPLES / "gpt_2d.py").read_text().splitlines()[2].strip()
    assert first_command.startswith("torchrun --standalone --nproc_per_node 4 examples/gpt_2d.py ")  # the hint's
