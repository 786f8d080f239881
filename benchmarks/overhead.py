"""Per-step overhead of dream_trainer against a plain PyTorch loop.

Tiny MLP (Linear 32-32-1), batch 64, 2000 steps, SGD, the same DataLoader in every case. Cases:
`plain` (the PyTorch loop), `dream` (DreamTrainer bare: no logger, bar or checkpoint) and
`dream_defaults` (rich progress bar, TensorBoard logging every step, a checkpoint at the end). All time the
same work after imports: build the data, model and optimizer, then train (the first optimizer call
imports torch._dynamo, about a second, so timing only the loop would hide it on one side). Each case runs
in a fresh process; cases are interleaved (plain, dream, plain, dream, ...) so drift on the machine
hits both alike. Reports the median wall time of each case and the median of the per-round ratios.

    python benchmarks/overhead.py                 # 7 rounds, 2000 steps
    python benchmarks/overhead.py --rounds 3 --steps 200   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CASES = ("plain", "dream", "dream_defaults")


def _data(steps: int, batch: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 32, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(steps * batch, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g)


def _model():
    from torch import nn

    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def run_plain(steps: int, batch: int) -> float:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    start = time.perf_counter()
    loader, model = _data(steps, batch), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def run_dream(steps: int, batch: int, defaults: bool = False) -> float:
    import torch
    import torch.nn.functional as F

    from dream_trainer import DreamTrainer, DreamTrainerConfig

    class Bench(DreamTrainer):
        def __init__(self, config: DreamTrainerConfig) -> None:
            super().__init__(config)
            self.model = _model()

        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

        def configure_dataloaders(self):
            return _data(steps, batch), None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.model(x), y)

    torch.manual_seed(0)
    start = time.perf_counter()
    if defaults:
        # Lightning-like defaults: a rich progress bar (drawn to a fake terminal, so its real cost is
        # measured although stdout is a pipe here), TensorBoard every step, a checkpoint at the end.
        import os

        from rich.console import Console

        from dream_trainer.callbacks import RichProgressBar

        console = Console(file=open(os.devnull, "w"), force_terminal=True, width=120)  # noqa: SIM115
        config = DreamTrainerConfig(
            n_epochs=1, seed=None, device="cpu", log_every_n_steps=1, root_dir=_tmpdir(),
            callbacks=[RichProgressBar(console=console)],
        )  # fmt: skip
    else:
        # Bare: nothing the plain loop does not do (no loggers, bar, checkpoint or summary line).
        config = DreamTrainerConfig(
            n_epochs=1, seed=None, device="cpu", loggers=[], enable_progress_bar=False,
            enable_checkpointing=False, print_epoch_summary=False,
        )  # fmt: skip
    trainer = Bench(config)
    trainer.fit()
    elapsed = time.perf_counter() - start
    assert trainer.global_step == steps, trainer.global_step
    return elapsed


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="dream-bench-")


def _worker(case: str, steps: int, batch: int) -> None:
    seconds = run_plain(steps, batch) if case == "plain" else run_dream(steps, batch, defaults=case == "dream_defaults")
    print(json.dumps({"case": case, "seconds": seconds}))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.batch)
        return {}
    times: dict[str, list[float]] = {c: [] for c in CASES}
    ratios: dict[str, list[float]] = {c: [] for c in CASES[1:]}
    for _ in range(args.rounds):
        for case in CASES:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", case, "--steps", str(args.steps), "--batch", str(args.batch)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            times[case].append(json.loads(out.strip().splitlines()[-1])["seconds"])
        for case in CASES[1:]:
            ratios[case].append(times[case][-1] / times["plain"][-1])
    result = {f"{c}_median_s": statistics.median(v) for c, v in times.items()}
    for case in CASES[1:]:
        result[f"{case}_ratio"] = statistics.median(ratios[case])
    print(f"tiny MLP, {args.steps} steps x batch {args.batch}, {args.rounds} interleaved rounds (fresh processes)")
    print("| case | median s | median of per-round ratios to plain |")
    print("|---|---|---|")
    for c in CASES:
        ratio = f"{result[f'{c}_ratio']:.3f}x" if c != "plain" else "1.000x"
        print(f"| {c} | {result[f'{c}_median_s']:.3f} | {ratio} |")
    return result


if __name__ == "__main__":
    main()
