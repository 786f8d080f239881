"""examples/gpt_2d.py: a tiny GPT on a 2-D mesh (dp_shard=2 x tensor_parallel=2) under torchrun, and on
one process with `--tp 1`. Both must learn: the validation loss falls from about ln(vocab) = 4.6."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import EXAMPLES, launcher_free_env, load_example, torchrun

pytestmark = pytest.mark.usefixtures("restore_torch_threads")  # main() sets the thread count


def test_help_lists_the_mesh_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_example("gpt_2d").parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tp", "--dp-shard", "--dp-replicate", "--pp", "--meta-init", "--activation-checkpointing"):
        assert flag in out, flag
    for flag in ("--max-steps", "--root-dir", "--quiet", "--seed", "--threads", "--metrics-out"):
        assert flag in out, flag


def test_one_process_learns(tmp_path: Path) -> None:
    # No torchrun, --tp 1: strategy "single", no mesh. 30 steps, ~8 s.
    argv = ["--tp", "1", "--max-steps", "30", "--root-dir", str(tmp_path), "--quiet"]
    r = load_example("gpt_2d").main(argv)
    assert (r["world_size"], r["strategy"], r["mesh"], r["dp_ranks"]) == (1, "single", {}, [0])
    assert r["global_step"] == 30
    assert r["val_loss_before"] > 4.0, r
    assert r["val_loss"] < r["val_loss_before"] - 1.0, r


@pytest.mark.slow
def test_torchrun_2d_mesh_learns(tmp_path: Path) -> None:
    # The documented command (defaults: dp_shard=-1 -> 2, tensor_parallel=2) on 4 CPU processes (gloo),
    # 30 steps: ~25 s on 2 cores. Rank 0 writes what main() returns.
    metrics = tmp_path / "metrics.json"
    cmd = torchrun("--standalone", "--nproc_per_node", "4", str(EXAMPLES / "gpt_2d.py"))
    cmd += ["--max-steps", "30", "--root-dir", str(tmp_path / "run"), "--metrics-out", str(metrics), "--quiet"]
    cmd += ["--device", "cpu"]  # 4 CPU processes on a GPU machine too
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launcher_free_env())
    assert result.returncode == 0, result.stdout + result.stderr
    done = [line for line in result.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1, result.stdout  # rank 0 alone prints
    r = json.loads(metrics.read_text())
    assert (r["world_size"], r["strategy"]) == (4, "model_parallel"), r
    assert r["mesh"] == {"dp_shard": 2, "tp": 2}, r
    assert r["dp_ranks"] == [0, 0, 1, 1], r  # the two ranks of a TP group read the same batches
    assert r["global_step"] == 30
    assert r["val_loss_before"] > 4.0, r
    assert r["val_loss"] < r["val_loss_before"] - 1.0, r
    # The end-of-fit checkpoint is a sharded DCP directory.
    assert [p for p in (tmp_path / "run").rglob("last.ckpt") if p.is_dir()], list((tmp_path / "run").rglob("*"))
