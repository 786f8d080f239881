"""The trainer's own cost per training step, in microseconds, measured in one process.

`overhead.py` and `tiny_mlp.py` time whole runs in fresh processes (what a user sees, setup and data
loading included); their ratios move by a few percent with the machine's noise, more than the
trainer's share of a tiny step. This script isolates that share: the same tiny MLP (Linear 32-32-1,
batch 64, SGD) trained on one fixed batch, alternating round by round between

- `plain`: `zero_grad / forward / mse_loss / backward / step`, and
- `dream`: `trainer.training_step(batch, i)` of a bare `DreamTrainer` (no logger, bar or checkpoint),
  set up once: the full step every batch goes through (window, backward, optimizer step, metric
  recording, hooks, the logging point every `log_every_n_steps`).

It reports the minimum and median time per step of each over the rounds and their difference, the
trainer's microseconds per step. Use it to find and check per-step work (see docs/performance.md).

`--no-model` takes the model's work out of both cases: the step returns a leaf tensor (its backward
only accumulates a scalar gradient) and the optimizer's `zero_grad`/`step` do nothing. What is left
is the trainer's own Python work, measured to about 0.2 us instead of the 1-2 us the tiny MLP's noise
allows; in a real step the same work costs 2-3x as much (the model's kernels evict it from the caches
between steps), which is why a saving shows here first.

    python benchmarks/step_overhead.py                  # 25 rounds x 2000 steps
    python benchmarks/step_overhead.py --rounds 3 --steps 200   # smoke run
    python benchmarks/step_overhead.py --no-model --steps 20000 # the trainer's Python work alone
    python benchmarks/step_overhead.py --set spike_policy=warn  # a setting's per-step cost (run both)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_mlp import _model, _optimizer  # the tiny MLP and SGD of every tiny-MLP case


def _setting(text: str) -> tuple[str, Any]:
    import ast

    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--set {text!r}: expected FIELD=VALUE, e.g. --set spike_policy=warn")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a plain string: spike_policy=warn


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--steps", type=int, default=2000, help="steps per round and case")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-model", action="store_true", help="no model work: a leaf loss, a no-op optimizer")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a DreamTrainerConfig field for the dream case (a Python literal, or a string), repeatable",
    )
    args = p.parse_args(argv)
    settings = dict(_setting(text) for text in args.set)

    import torch
    import torch._dynamo  # the first optimizer step imports it: not part of any round
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from dream_trainer import DreamTrainer, DreamTrainerConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    batch = (x, y)

    class NoOpOptimizer(torch.optim.Optimizer):
        """--no-model: an optimizer that does nothing (its `step` keeps torch's wrapper, as SGD's does)."""

        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

        def step(self, closure: Any = None) -> None:
            pass

    leaf_loss = torch.tensor(1.0, requires_grad=True)
    make_optimizer = NoOpOptimizer if args.no_model else _optimizer

    def loss_of(model: Any, bx: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
        return leaf_loss if args.no_model else F.mse_loss(model(bx), by)

    plain_model = _model()
    plain_opt = make_optimizer(plain_model.parameters())

    class Bench(DreamTrainer):
        def __init__(self, config: DreamTrainerConfig) -> None:
            super().__init__(config)
            self.model = _model()

        def configure_optimizers(self) -> None:
            self.optimizer = make_optimizer(self.model.parameters())

        def configure_dataloaders(self) -> Any:
            # As long as a round (the steps are numbered 0..steps-1): no step is past the epoch's last batch.
            return DataLoader(
                TensorDataset(x.expand(args.steps, 64, 32), y.expand(args.steps, 64, 1)), batch_size=None
            ), None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            bx, by = batch
            return loss_of(self.model, bx, by)

    config = DreamTrainerConfig(
        n_epochs=1, seed=None, device="cpu", root_dir=tempfile.mkdtemp(prefix="dream-step-"), loggers=[],
        enable_progress_bar=False, enable_checkpointing=False, print_epoch_summary=False, **settings,
    )  # fmt: skip
    trainer = Bench(config)
    trainer._setup_fit()  # what fit() does before its loop
    trainer._train_epoch_start()
    dream_step = trainer.training_step
    steps = args.steps

    def plain() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            plain_opt.zero_grad(set_to_none=True)
            loss_of(plain_model, x, y).backward()
            plain_opt.step()
        return (time.perf_counter() - start) / steps * 1e6

    def dream() -> float:
        start = time.perf_counter()
        for i in range(steps):
            dream_step(batch, i)
        return (time.perf_counter() - start) / steps * 1e6

    times: dict[str, list[float]] = {"plain": [], "dream": []}
    plain(), dream()  # warm-up round
    for _ in range(args.rounds):
        times["plain"].append(plain())
        times["dream"].append(dream())
    result = {f"{c}_{s}_us": f(v) for c, v in times.items() for s, f in (("min", min), ("median", statistics.median))}
    result["overhead_min_us"] = result["dream_min_us"] - result["plain_min_us"]
    result["overhead_median_us"] = result["dream_median_us"] - result["plain_median_us"]
    print(
        ("no model work (a leaf loss, a no-op optimizer)" if args.no_model else "tiny MLP step")
        + f", one fixed batch, {args.rounds} alternating rounds x {steps} steps, "
        f"{args.threads} thread(s); command: `python benchmarks/step_overhead.py"
        + (" --no-model" if args.no_model else "")
        + (f" --rounds {args.rounds} --steps {steps}" if (args.rounds, steps) != (25, 2000) else "")
        + "".join(f" --set {text}" for text in args.set)
        + "`\n"
    )
    print("| case | min us/step | median us/step |\n|---|---:|---:|")
    for c in times:
        print(f"| {c} | {result[f'{c}_min_us']:.2f} | {result[f'{c}_median_us']:.2f} |")
    print(
        f"| dream - plain | {result['overhead_min_us']:.2f} | {result['overhead_median_us']:.2f} |\n\n"
        f"the trainer's share: {result['overhead_min_us']:.1f} us per step "
        f"({result['dream_min_us'] / result['plain_min_us']:.3f}x the plain step, best rounds)"
    )
    return result


if __name__ == "__main__":
    main()
