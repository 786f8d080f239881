"""What the port benchmarks share (port_lightning.py, port_lightning_lstm.py, port_gan.py): Lightning's
Trainer and our config set up alike (no logger, checkpoint, bar or summary), a timed fit, one thread,
bit-identical weight checks, and the rounds loop that prints the time ratios."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dream_trainer import DreamTrainerConfig


def lightning_trainer(max_steps: int) -> Any:
    """Lightning's Trainer on the CPU with nothing but training: no logger, checkpoint, bar, summary or
    sanity check."""
    import lightning as L

    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def ours_config(steps: int, root: str, seed: int = 0) -> DreamTrainerConfig:
    """The DreamTrainer counterpart of `lightning_trainer`: `steps` training steps and nothing else."""
    return DreamTrainerConfig(
        seed=seed,
        n_epochs=None,
        max_steps=steps,
        device="cpu",
        root_dir=root,
        loggers=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        print_epoch_summary=False,
    )


def timed(fit: Callable[[], Any]) -> float:
    """Seconds `fit()` takes."""
    start = time.perf_counter()
    fit()
    return time.perf_counter() - start


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> bool:
    """Every tensor whose name starts with `prefix` bit-identical in `a` and `b` (same names)."""
    keys = [k for k in a if k.startswith(prefix)]
    return a.keys() == b.keys() and bool(keys) and all(torch.equal(a[k], b[k]) for k in keys)


@contextmanager
def one_thread() -> Iterator[None]:
    """Both trainers on one intra-op thread: the same summation order, so fp32 weights can be equal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def main(
    doc: str,
    compare: Callable[[int, str], tuple[bool, float, dict[str, float]]],
    default_steps: int,
) -> None:
    """`--steps`/`--rounds` from the command line; each round runs `compare(steps, root)` -> (weights
    equal, Lightning's seconds, {port name: seconds}) and prints the times; then each port's median
    ratio to Lightning."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            equal, t_l, ours = compare(args.steps, root)
            parts = []
            for name, t_o in ours.items():
                ratios.setdefault(name, []).append(t_o / t_l)
                parts.append(f"{name} {t_o:.3f} s ({t_o / t_l:.3f}x)")
            print(f"round {r}: Lightning {t_l:.3f} s, " + ", ".join(parts) + f", weights equal: {equal}")
    for name, values in ratios.items():
        median = sorted(values)[len(values) // 2]
        print(f"median ratio {name} / Lightning: {median:.3f}x ({args.steps} steps, 1 thread)")
