"""Every script in examples/ runs, in-process with small settings, and learns what it says it learns."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import EXAMPLES, load_example, run_python_forked

pytestmark = pytest.mark.usefixtures("restore_torch_threads")  # main() sets the thread count


def test_classifier_learns(tmp_path: Path) -> None:
    # 288 steps: ~2 s. Verified: val_accuracy 0.916 (seed 0); seeds 1 and 2 give 0.912 and 0.885.
    argv = ["--epochs", "3", "--n-train", "3072", "--n-val", "512", "--batch-size", "32", "--lr", "5e-3"]
    metrics = load_example("classifier").main([*argv, "--root-dir", str(tmp_path), "--quiet"])
    assert metrics["val_accuracy"] > 0.8, metrics
    assert metrics["global_step"] == 3 * 3072 // 32
    assert metrics["epochs"] == 3
    assert metrics["loss"] < 0.5, metrics


def test_classifier_help() -> None:
    result = run_python_forked(EXAMPLES / "classifier.py", "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in ("--epochs", "--n-train", "--seed", "--root-dir"):
        assert flag in result.stdout


@pytest.mark.slow
def test_classifier_full_run(tmp_path: Path) -> None:
    # The README's run, as `python examples/classifier.py` does it (~15 s of training on one thread).
    metrics = load_example("classifier").main(["--root-dir", str(tmp_path), "--quiet"])
    assert metrics["val_accuracy"] > 0.95, metrics
    assert metrics["global_step"] == 10 * 8192 // 64


def test_gan_improves(tmp_path: Path) -> None:
    # 96 steps: ~1.5 s. Verified: mean distance to the nearest mode 1.72 -> about 0.9.
    argv = ["--epochs", "3", "--n-train", "4096", "--batch-size", "128", "--root-dir", str(tmp_path), "--quiet"]
    results = load_example("gan").main(argv)
    assert results["mode_distance"] < 0.7 * results["mode_distance_before"], results
    # Two optimizers stepped per batch, but one training step per batch.
    assert results["global_step"] == results["batches"] == 3 * 4096 // 128


def test_custom_loop_learns(tmp_path: Path) -> None:
    argv = ["--epochs", "6", "--n-train", "2048", "--target-loss", "0", "--root-dir", str(tmp_path), "--quiet"]
    results = load_example("custom_loop").main(argv)
    assert results["epochs"] == 6
    assert results["global_step"] == 6 * 2048 // 64
    assert results["val_loss"] < 0.5 * results["first_val_loss"], results
    assert results["val_loss"] < 0.1 * results["baseline_val_loss"], results


def test_custom_loop_stops_at_target(tmp_path: Path) -> None:
    # A target any trained model meets: the custom loop stops after its first validation.
    argv = ["--epochs", "5", "--n-train", "512", "--target-loss", "10", "--root-dir", str(tmp_path), "--quiet"]
    results = load_example("custom_loop").main(argv)
    assert results["epochs"] == 1
    assert results["global_step"] == 512 // 64


def test_trainer_guide_all_parts(tmp_path: Path) -> None:
    guide = load_example("trainer_guide")
    parts = [name for name in guide.PARTS if name != "compile"]  # compile: see the slow test below
    results = guide.main(["--epochs", "2", "--root-dir", str(tmp_path), "--parts", *parts])
    assert set(results) == set(parts)
    failed = {name: res for name, res in results.items() if not res["ok"]}
    assert not failed, f"Trainer Guide parts failed: {failed}"
    assert results["checkpoint"]["weights_equal"]
    assert results["checkpoint"]["optimizer_restored"]


@pytest.mark.slow
def test_trainer_guide_compile(tmp_path: Path) -> None:
    results = load_example("trainer_guide").main(["--epochs", "2", "--root-dir", str(tmp_path), "--parts", "compile"])
    assert results["compile"]["ok"], results
