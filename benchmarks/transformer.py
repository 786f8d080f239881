"""A small decoder-only transformer language model, compute-bound: plain PyTorch vs dream_trainer vs Lightning.

4 pre-norm layers, d_model 256, 4 heads, MLP 1024, causal self-attention over 128 tokens, vocabulary 256
(3.3M parameters), batch 16, AdamW, next-token cross-entropy on generated tokens (a noisy Markov
chain, so the loss falls). Each step is a few hundred milliseconds of matrix work on 2 cores, so a
framework's per-step cost should vanish: the target is dream_trainer <= 1.02x the plain loop.

Cases: `plain` (the PyTorch loop), `dream` (DreamTrainer bare: no loggers, bar, checkpoint or summary
line) and `lightning` (Lightning minimal: `logger=False`, no bar, no checkpointing, no model summary).
Each run is a fresh process; the timed section is the same work in every case (build the data, model,
optimizer, trainer, then train), after the imports (torch._dynamo included). torch uses its default
number of threads.

    python benchmarks/transformer.py                  # 5 interleaved rounds of 20 steps
    python benchmarks/transformer.py --rounds 1 --steps 2
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

CASES = ("plain", "dream", "lightning")
LIGHTNING_CASES = frozenset({"lightning"})
LABELS = {"plain": "plain PyTorch loop", "dream": "dream_trainer bare", "lightning": "Lightning minimal"}

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 256, 256, 4, 4, 128, 16
DEFAULT_STEPS = 20


def describe(steps: int) -> str:
    return f"{LAYERS} layers, d_model {D_MODEL}, seq {SEQ}, batch {BATCH}, {steps} steps"


def _suite() -> Any:
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import suite

    return suite


# --- the work, identical in every case --------------------------------------------------------------
def _tokens(steps: int) -> Any:
    """`steps * BATCH` sequences of SEQ tokens: each token follows from the previous one by a fixed random
    permutation, except 10% that are drawn at random."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    perm = torch.randperm(VOCAB, generator=g)
    tokens = torch.empty(n, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    noise = torch.rand(n, SEQ, generator=g) < 0.1
    random_tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    for t in range(1, SEQ):
        tokens[:, t] = torch.where(noise[:, t], random_tokens[:, t], perm[tokens[:, t - 1]])
    return tokens


def _data(steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(_tokens(steps)), batch_size=BATCH, shuffle=True, generator=g)


def _model() -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
            layer = nn.TransformerEncoderLayer(
                D_MODEL, HEADS, 4 * D_MODEL, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) + self.pos[: tokens.shape[1]]
            h = self.blocks(h, mask=self.mask, is_causal=True)
            return self.head(self.norm(h))

    return TinyLM()


def _loss(model: Any, tokens: Any) -> Any:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _optimizer(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=3e-4)


# --- the cases ----------------------------------------------------------------------------------------
def run_plain(steps: int) -> dict[str, Any]:
    import torch

    start = time.perf_counter()
    torch.manual_seed(0)
    loader, model = _data(steps), _model()
    opt = _optimizer(model.parameters())
    n = 0
    for (tokens,) in loader:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        n += 1
    seconds = time.perf_counter() - start
    assert n == steps, n
    return {"seconds": seconds, "final_loss": loss.item()}


def run_dream(steps: int) -> dict[str, Any]:
    import torch

    from dream_trainer import DreamTrainer, DreamTrainerConfig

    class Bench(DreamTrainer):
        def __init__(self, config: DreamTrainerConfig) -> None:
            super().__init__(config)
            self.model = _model()

        def configure_optimizers(self) -> None:
            self.optimizer = _optimizer(self.model.parameters())

        def configure_dataloaders(self) -> Any:
            return _data(steps), None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            self.last_loss = _loss(self.model, tokens)
            return self.last_loss

    root = tempfile.mkdtemp(prefix="dream-bench-lm-")
    start = time.perf_counter()
    torch.manual_seed(0)
    config = DreamTrainerConfig(
        n_epochs=1, seed=None, device="cpu", root_dir=root, loggers=[], enable_progress_bar=False,
        enable_checkpointing=False, print_epoch_summary=False,
    )  # fmt: skip
    trainer = Bench(config)
    trainer.fit()
    seconds = time.perf_counter() - start
    assert trainer.global_step == steps, trainer.global_step
    shutil.rmtree(root, ignore_errors=True)
    return {"seconds": seconds, "final_loss": trainer.last_loss.item()}


def run_lightning(steps: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (tokens,) = batch
            self.last_loss = _loss(self.model, tokens)
            return self.last_loss

        def configure_optimizers(self) -> Any:
            return _optimizer(self.parameters())

    root = tempfile.mkdtemp(prefix="dream-bench-lm-lightning-")
    start = time.perf_counter()
    torch.manual_seed(0)
    loader, module = _data(steps), LitLM()
    trainer = pl.Trainer(
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        max_epochs=1, accelerator="cpu", devices=1, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    seconds = time.perf_counter() - start
    assert trainer.global_step == steps, trainer.global_step
    shutil.rmtree(root, ignore_errors=True)
    return {"seconds": seconds, "final_loss": module.last_loss.item()}


def worker(case: str, steps: int) -> None:
    import torch
    import torch._dynamo  # the first optimizer step imports it: keep it out of every timing
    import torch.nn.functional
    import torch.utils.data

    if case == "dream":
        import dream_trainer  # noqa: F401
    if case == "lightning":
        import lightning.pytorch  # noqa: F401
    run = {"plain": run_plain, "dream": run_dream, "lightning": run_lightning}[case]
    result = run(steps)
    s = _suite()
    s.emit({"case": case, **result, "peak_rss_mb": s.peak_rss_mb(), "torch_threads": torch.get_num_threads()})


# --- orchestration ------------------------------------------------------------------------------------
def worker_argv(case: str, steps: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--steps", str(steps)]


def measure(
    cases: list[str] | tuple[str, ...] = CASES, rounds: int = 5, steps: int = DEFAULT_STEPS, warmup: bool = False
) -> dict[str, Any]:
    s = _suite()
    assert cases and cases[0] == "plain", "the plain loop is the baseline: list it first"
    runs = s.interleave({c: worker_argv(c, steps) for c in cases}, rounds, warmup=warmup, label="transformer")
    return {
        "seconds": {c: [r["seconds"] for r in v] for c, v in runs.items()},
        "final_loss": {c: [r["final_loss"] for r in v] for c, v in runs.items()},
        "torch_threads": runs["plain"][0]["torch_threads"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return {}
    s = _suite()
    cases = [c for c in CASES if s.lightning_version() or c not in LIGHTNING_CASES]
    raw = measure(cases, args.rounds, args.steps, warmup=args.rounds > 1)
    print(f"transformer LM ({describe(args.steps)}), {args.rounds} interleaved round(s), fresh processes")
    print("| case | median s | ratio to plain | final loss |")
    print("|---|---:|---:|---:|")
    for c in cases:
        secs = raw["seconds"][c]
        r = s.median_ratio(secs, raw["seconds"]["plain"])
        print(f"| {LABELS[c]} | {statistics.median(secs):.3f} | {r:.3f}x | {raw['final_loss'][c][-1]:.3f} |")
    return raw


if __name__ == "__main__":
    main()
