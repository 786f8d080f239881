"""Tiny MLP: the per-step overhead of dream_trainer (and of Lightning) against a plain PyTorch loop.

Linear 32-32-1, batch 64, 2000 steps of SGD, the same shuffled DataLoader, model, optimizer and seed
in every case:

- `plain`: the PyTorch loop (`zero_grad / forward / backward / step`);
- `dream`: DreamTrainer bare: `loggers=[]`, no progress bar, no checkpointing, no epoch summary line;
- `dream_defaults`: DreamTrainer with its defaults: TensorBoard (logging every step, as
  `log_every_n_steps=1`), a rich progress bar (drawn on a fake terminal so its real cost is measured
  although stdout is a file here), a `ModelCheckpoint(save_last=True)` at the end of the epoch, the
  epoch summary line;
- `lightning_minimal`: `Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False,
  enable_model_summary=False, max_epochs=1, accelerator="cpu", devices=1)`;
- `lightning_defaults`: `Trainer(max_epochs=1, accelerator="cpu", devices=1, log_every_n_steps=1)`: its
  default TensorBoard logger, TQDM progress bar (to stderr, a file here), model summary and checkpoint
  at the end; the module logs its loss every step (`self.log("loss", loss, prog_bar=True)`), as
  dream_trainer logs the returned loss.

Each run is a fresh process; the timed section is the same work everywhere: build the data, model and
optimizer (and trainer), then train. Imports (torch, torch._dynamo, which the first optimizer step
imports, dream_trainer, lightning, and for the defaults the TensorBoard writer and rich, which both
frameworks import when the run starts) come before it, on every side: they are one-off costs, which
benchmarks/import_time.py reports. Peak RSS is `ru_maxrss` at the end.
torch runs one intra-op thread in every case (`torch.set_num_threads(1)`): this model cannot use more.

    python benchmarks/tiny_mlp.py                      # 7 interleaved rounds, 2000 steps
    python benchmarks/tiny_mlp.py --rounds 1 --steps 50 --cases plain,dream
    python benchmarks/suite.py --only tiny             # the same through the suite's table
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = ("plain", "dream", "dream_defaults", "lightning_minimal", "lightning_defaults")
LIGHTNING_CASES = frozenset({"lightning_minimal", "lightning_defaults"})
LABELS = {
    "plain": "plain PyTorch loop",
    "dream": "dream_trainer bare",
    "dream_defaults": "dream_trainer defaults (rich bar, TensorBoard every step, checkpoint)",
    "lightning_minimal": "Lightning minimal",
    "lightning_defaults": "Lightning defaults (TQDM bar, TensorBoard every step, checkpoint, summary)",
}


def _suite() -> Any:
    """benchmarks/suite.py (stdlib only), for the helpers shared by every case module."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import suite

    return suite


# --- the work, identical in every case --------------------------------------------------------------
def _data(steps: int, batch: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 32, generator=g)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(steps * batch, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g)


def _model() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def _optimizer(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.01)


class _Clock:
    """Starts the timed section (and notes the RSS the imports left) when built."""

    def __init__(self) -> None:
        self.rss_before_mb = _suite().current_rss_mb()
        self.start = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        return {"seconds": time.perf_counter() - self.start, "rss_before_mb": self.rss_before_mb}


# --- the cases ----------------------------------------------------------------------------------------
def run_plain(steps: int, batch: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    clock = _Clock()
    torch.manual_seed(0)
    loader, model = _data(steps, batch), _model()
    opt = _optimizer(model.parameters())
    n = 0
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        n += 1
    out = clock.stop()
    assert n == steps, n
    return out


def run_dream(steps: int, batch: int, defaults: bool = False) -> dict[str, Any]:
    import os

    import torch
    import torch.nn.functional as F

    from dream_trainer import DreamTrainer, DreamTrainerConfig

    if defaults:
        from rich.console import Console

        from dream_trainer.callbacks import RichProgressBar

    class Bench(DreamTrainer):
        def __init__(self, config: DreamTrainerConfig) -> None:
            super().__init__(config)
            self.model = _model()

        def configure_optimizers(self) -> None:
            self.optimizer = _optimizer(self.model.parameters())

        def configure_dataloaders(self) -> Any:
            return _data(steps, batch), None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.mse_loss(self.model(x), y)

    root = tempfile.mkdtemp(prefix="dream-bench-tiny-")
    devnull = open(os.devnull, "w")  # noqa: SIM115
    clock = _Clock()
    torch.manual_seed(0)
    if defaults:
        console = Console(file=devnull, force_terminal=True, width=120)
        config = DreamTrainerConfig(
            n_epochs=1, seed=None, device="cpu", log_every_n_steps=1, root_dir=root,
            callbacks=[RichProgressBar(console=console)],
        )  # fmt: skip
    else:
        config = DreamTrainerConfig(
            n_epochs=1, seed=None, device="cpu", root_dir=root, loggers=[], enable_progress_bar=False,
            enable_checkpointing=False, print_epoch_summary=False,
        )  # fmt: skip
    trainer = Bench(config)
    trainer.fit()
    out = clock.stop()
    assert trainer.global_step == steps, trainer.global_step
    if defaults:
        assert any(Path(root).rglob("*.ckpt")), "dream_defaults wrote no checkpoint"
        assert any(Path(root).rglob("events.out.tfevents*")), "dream_defaults wrote no TensorBoard events"
    devnull.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def run_lightning(steps: int, batch: int, defaults: bool = False) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    class LitBench(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            if defaults:
                self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return _optimizer(self.parameters())

    root = tempfile.mkdtemp(prefix="dream-bench-lightning-")
    clock = _Clock()
    torch.manual_seed(0)
    loader, module = _data(steps, batch), LitBench()
    if defaults:
        trainer = pl.Trainer(
            max_epochs=1, accelerator="cpu", devices=1, log_every_n_steps=1, default_root_dir=root,
        )  # fmt: skip
    else:
        trainer = pl.Trainer(
            logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            max_epochs=1, accelerator="cpu", devices=1, default_root_dir=root,
        )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    out = clock.stop()
    assert trainer.global_step == steps, trainer.global_step
    if defaults:
        assert any(Path(root).rglob("*.ckpt")), "lightning_defaults wrote no checkpoint"
        assert any(Path(root).rglob("events.out.tfevents*")), "lightning_defaults wrote no TensorBoard events"
    shutil.rmtree(root, ignore_errors=True)
    return out


def worker(case: str, steps: int, batch: int) -> None:
    import torch
    import torch._dynamo  # the first optimizer step imports it: keep it out of every timing
    import torch.nn.functional
    import torch.utils.data

    # One intra-op thread: the model is far too small to use more, and with two, OpenMP barriers made
    # runs 10-40x slower (and wildly noisy) whenever other processes held the cores.
    torch.set_num_threads(1)
    if case.startswith("dream"):
        import dream_trainer  # noqa: F401
    if case.startswith("lightning"):
        import lightning.pytorch  # noqa: F401
    # Both TensorBoard loggers import their writer when the run starts (once per process;
    # import_time.py reports it): keep that out of the timing, like every other import. Each side
    # imports what its own logger uses (and its peak RSS includes it).
    if case == "lightning_defaults":
        import torch.utils.tensorboard
        import torch.utils.tensorboard.summary
    if case == "dream_defaults":
        import rich.progress  # noqa: F401
        import tensorboard.compat.proto.event_pb2
        import tensorboard.compat.proto.summary_pb2
        import tensorboard.plugins.hparams.plugin_data_pb2
        import tensorboard.plugins.text.plugin_data_pb2  # noqa: F401
    if case == "plain":
        result = run_plain(steps, batch)
    elif case.startswith("dream"):
        result = run_dream(steps, batch, defaults=case == "dream_defaults")
    else:
        result = run_lightning(steps, batch, defaults=case == "lightning_defaults")
    s = _suite()
    s.emit({"case": case, **result, "peak_rss_mb": s.peak_rss_mb(), "torch_threads": torch.get_num_threads()})


# --- orchestration ------------------------------------------------------------------------------------
def worker_argv(case: str, steps: int, batch: int) -> list[str]:
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--worker", case, "--steps", str(steps), "--batch", str(batch)]


def measure(
    cases: list[str] | tuple[str, ...] = CASES,
    rounds: int = 7,
    steps: int = 2000,
    batch: int = 64,
    warmup: bool = False,
) -> dict[str, Any]:
    """Run `cases` interleaved for `rounds` rounds; each case's seconds and peak RSS, in round order."""
    s = _suite()
    assert cases and cases[0] == "plain", "the plain loop is the baseline: list it first"
    runs = s.interleave({c: worker_argv(c, steps, batch) for c in cases}, rounds, warmup=warmup, label="tiny MLP")
    return {
        "seconds": {c: [r["seconds"] for r in v] for c, v in runs.items()},
        "peak_rss_mb": {c: [r["peak_rss_mb"] for r in v] for c, v in runs.items()},
        "rss_before_mb": {c: [r["rss_before_mb"] for r in v] for c, v in runs.items()},
        "torch_threads": runs["plain"][0]["torch_threads"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cases", help=f"comma-separated subset of {','.join(CASES)} (plain is always run)")
    p.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.batch)
        return {}
    s = _suite()
    wanted = set(args.cases.split(",")) if args.cases else set(CASES)
    cases = [c for c in CASES if c == "plain" or (c in wanted and (s.lightning_version() or c not in LIGHTNING_CASES))]
    raw = measure(cases, args.rounds, args.steps, args.batch, warmup=args.rounds > 1)
    print(f"tiny MLP, {args.steps} steps x batch {args.batch}, {args.rounds} interleaved round(s), fresh processes")
    print("| case | median s | ratio to plain | peak RSS MiB | RSS ratio |")
    print("|---|---:|---:|---:|---:|")
    for c in cases:
        secs, rss = raw["seconds"][c], raw["peak_rss_mb"][c]
        r = s.median_ratio(secs, raw["seconds"]["plain"])
        m = s.median_ratio(rss, raw["peak_rss_mb"]["plain"])
        print(f"| {LABELS[c]} | {statistics.median(secs):.3f} | {r:.3f}x | {statistics.median(rss):.0f} | {m:.3f}x |")
    return raw


if __name__ == "__main__":
    main()
