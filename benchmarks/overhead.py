"""Per-step overhead of dream_trainer against a plain PyTorch loop.

Tiny MLP (Linear 32-32-1), batch 64, 2000 steps, SGD, the same DataLoader in both. Both time the
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

CASES = ("plain", "dream")


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


def run_dream(steps: int, batch: int) -> float:
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
    trainer = Bench(DreamTrainerConfig(n_epochs=1, seed=None, print_epoch_summary=False, device="cpu"))
    trainer.fit()
    elapsed = time.perf_counter() - start
    assert trainer.global_step == steps, trainer.global_step
    return elapsed


def _worker(case: str, steps: int, batch: int) -> None:
    fn = {"plain": run_plain, "dream": run_dream}[case]
    print(json.dumps({"case": case, "seconds": fn(steps, batch)}))


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
    ratios: list[float] = []
    for _ in range(args.rounds):
        for case in CASES:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", case, "--steps", str(args.steps), "--batch", str(args.batch)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            times[case].append(json.loads(out.strip().splitlines()[-1])["seconds"])
        ratios.append(times["dream"][-1] / times["plain"][-1])
    result = {f"{c}_median_s": statistics.median(v) for c, v in times.items()}
    result["ratio_median"] = statistics.median(ratios)
    print(f"tiny MLP, {args.steps} steps x batch {args.batch}, {args.rounds} interleaved rounds (fresh processes)")
    print("| case | median s | ratio to plain |")
    print("|---|---|---|")
    for c in CASES:
        print(f"| {c} | {result[f'{c}_median_s']:.3f} | {result[f'{c}_median_s'] / result['plain_median_s']:.3f}x |")
    print(f"median of per-round ratios dream/plain: {result['ratio_median']:.3f}x")
    return result


if __name__ == "__main__":
    main()
