"""The gallery examples run with small settings and show what they say they show.

In-process `main()` for every example (resume_after_kill spawns and SIGKILLs a child process of its
own; distributed runs as a single process). Slow: resume_after_kill run as a script, and distributed
launched with `torchrun` on two CPU processes (gloo), with DDP and with FSDP.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLES, launcher_free_env, load_example, run_python_forked, torchrun

GALLERY = ("torchmetrics_classifier", "ema", "resume_after_kill", "distributed", "char_lm")

pytestmark = pytest.mark.usefixtures("restore_torch_threads")  # main() sets the thread count


@pytest.mark.parametrize("name", GALLERY)
def test_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_example(name).parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--root-dir", "--seed", "--threads"):
        assert flag in out, (name, flag)


def test_torchmetrics_classifier(tmp_path: Path) -> None:
    # 256 steps, ~2 s. Verified: val_accuracy 0.91-0.93 for seeds 0-2 (majority class: ~43%).
    argv = ["--epochs", "4", "--n-train", "4096", "--n-val", "1024", "--root-dir", str(tmp_path), "--quiet"]
    metrics = load_example("torchmetrics_classifier").main(argv)
    assert metrics["val_accuracy"] > 0.85, metrics
    # Every torchmetrics attribute reached callback_metrics: the collection under its own keys, the
    # train_ one from the training epoch.
    for key in ("val_f1", "val_precision", "val_recall", "train_accuracy"):
        assert 0.5 < metrics[key] <= 1.0, (key, metrics)
    assert "val_confusion" not in metrics  # not a scalar: computed, not logged
    assert metrics["global_step"] == 4 * 4096 // 64


def test_ema(tmp_path: Path) -> None:
    # 1024 steps, ~2 s. Verified for seeds 0-4: the EMA's val MSE is 45-73% below the live weights'.
    argv = ["--epochs", "4", "--n-train", "4096", "--decay", "0.99", "--root-dir", str(tmp_path), "--quiet"]
    r = load_example("ema").main(argv)
    assert r["max_weight_diff"] > 1e-3, r  # the average is not the weights
    assert r["ema_updates"] == r["global_step"] == 4 * 4096 // 16
    # It learned: far below predicting the mean, and better than after the first epoch.
    assert r["live_val_loss"] < 0.2 * r["mean_baseline_val_loss"], r
    assert r["live_val_loss"] < r["first_epoch_live_val_loss"], r
    assert r["ema_val_loss"] < r["live_val_loss"], r
    # Validation ran with the EMA weights swapped in: its val_loss is the EMA's, not the live weights'.
    assert r["val_loss"] == pytest.approx(r["ema_val_loss"], rel=1e-4), r
    assert torch.load(tmp_path / "ema_weights.pt", weights_only=True).keys() >= {"0.weight", "4.bias"}


def test_resume_after_kill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # main() in this process; it runs the reference here and the killed child in a subprocess.
    # 32 steps per epoch, checkpoints every 10: killed at step 45 (epoch 1, batch 12), resumed at 40.
    argv = ["--epochs", "2", "--n-train", "1024", "--every-n-steps", "10", "--kill-at-step", "45"]
    r = load_example("resume_after_kill").main([*argv, "--root-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert r["child_returncode"] == -9, out  # SIGKILL
    assert r["resumed_from_step"] == 40, out  # really resumed, mid-epoch (not from scratch)
    assert r["global_step"] == r["reference_global_step"] == 64
    assert r["equal"] is True, out
    assert "torch.equal: True" in out and "torch.equal: False" not in out, out


@pytest.mark.slow
def test_resume_after_kill_script(tmp_path: Path) -> None:
    # As documented: `python examples/resume_after_kill.py` (default settings), exit code 0 when equal.
    script = EXAMPLES / "resume_after_kill.py"
    result = run_python_forked(script, "--root-dir", tmp_path, timeout=300, env=launcher_free_env())
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "returncode -9" in out, out
    assert "resumed from step 75 (epoch 1" in out, out
    assert "weights EQUAL" in out, out
    assert (tmp_path / "interrupted" / "version_0" / "checkpoints" / "last.ckpt").exists()


def test_distributed_single_process(tmp_path: Path) -> None:
    # No torchrun: one process, no process group, the model is not wrapped.
    argv = ["--epochs", "2", "--n-train", "2048", "--root-dir", str(tmp_path), "--quiet"]
    r = load_example("distributed").main(argv)
    assert (r["world_size"], r["strategy"], r["wrapper"]) == (1, "single", "Sequential")
    assert r["samples_per_rank"] == [2 * 2048]
    assert r["global_step"] == 2 * 2048 // 32
    assert r["val_accuracy"] > 0.85, r


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "wrapper"), [("ddp", "DistributedDataParallel"), ("fsdp", "FSDPSequential")])
def test_distributed_torchrun(tmp_path: Path, strategy: str, wrapper: str) -> None:
    # 2 CPU processes over gloo; each trains on half of every epoch. ~10 s (ddp), ~15 s (fsdp).
    cmd = torchrun("--standalone", "--nproc_per_node", "2")
    cmd += [str(EXAMPLES / "distributed.py"), "--strategy", strategy, "--root-dir", str(tmp_path)]
    cmd += ["--epochs", "2", "--n-train", "2048", "--quiet", "--device", "cpu"]  # CPU processes on a GPU machine too
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=launcher_free_env())
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    done = [line for line in out.splitlines() if line.startswith("done:")]
    assert len(done) == 1, out  # only rank 0 prints
    assert f"2 process(es) on cpu, strategy {strategy}, model wrapped as {wrapper}" in done[0], done
    assert "samples trained on per rank [2048, 2048]" in done[0], done  # 2 epochs x 1024 each
    assert f"{2 * 2048 // 64} steps" in done[0], done
    accuracy = float(re.search(r"val_accuracy ([\d.]+)%", done[0]).group(1))  # type: ignore[union-attr]
    assert accuracy > 85, done
    # FSDP writes a sharded checkpoint directory, DDP one file; last.ckpt points at it either way.
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_dir() if strategy == "fsdp" else last.is_file()


def test_char_lm_learns(tmp_path: Path) -> None:
    # 30 steps of a smaller model, ~3 s: the loss falls from ~ln(vocab) = 4.6 to below 3.5.
    argv = ["--max-steps", "30", "--block-size", "32", "--d-model", "48", "--sample-len", "40"]
    r = load_example("char_lm").main([*argv, "--root-dir", str(tmp_path), "--quiet"])
    assert r["global_step"] == 30
    assert r["val_loss_before"] > 4.0, r
    assert r["val_loss"] < r["val_loss_before"] - 1.0, r
    assert isinstance(r["sample"], str) and len(r["sample"]) == 40


def test_char_lm_bf16(tmp_path: Path) -> None:
    argv = ["--max-steps", "8", "--block-size", "16", "--d-model", "32", "--layers", "1", "--sample-len", "12"]
    r = load_example("char_lm").main([*argv, "--precision", "bf16", "--root-dir", str(tmp_path), "--quiet"])
    assert r["global_step"] == 8
    assert r["val_loss"] < r["val_loss_before"], r
    assert len(r["sample"]) == 12
