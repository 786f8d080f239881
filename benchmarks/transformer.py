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

On a GPU (`--device cuda --bf16 --compile`: bf16 autocast and `torch.compile` in every case, through
each framework's own switch) the report adds tokens/s; `--warm-steps K` times the steps after the
first K apart (compilation and autotuning happen in those), from the end of step K to the end of the
last step, so the steady rate is visible (the trainers' end-of-run work, after the last step, counts in
the overall rate only):

    python benchmarks/transformer.py                  # 5 interleaved rounds of 20 steps
    python benchmarks/transformer.py --rounds 1 --steps 2
    python benchmarks/transformer.py --device cuda --bf16 --compile --batch 64 --d-model 1024 --layers 8 \
        --steps 300 --warm-steps 50 --rounds 3
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
# Set from the command line in each worker (see `_configure`): the device, bf16 autocast, torch.compile.
DEVICE, BF16, COMPILE, WARM_STEPS = "cpu", False, False, 0


def describe(steps: int) -> str:
    extra = "".join(f", {x}" for x, on in (("bf16", BF16), ("torch.compile", COMPILE)) if on)
    return f"{LAYERS} layers, d_model {D_MODEL}, seq {SEQ}, batch {BATCH}, {steps} steps, {DEVICE}{extra}"


def _configure(args: argparse.Namespace) -> None:
    global D_MODEL, LAYERS, BATCH, DEVICE, BF16, COMPILE, WARM_STEPS
    D_MODEL, LAYERS, BATCH = args.d_model, args.layers, args.batch
    DEVICE, BF16, COMPILE, WARM_STEPS = args.device, args.bf16, args.compile, args.warm_steps


def _sync() -> None:
    """Wait for the device: a CUDA step is only done when its kernels are (a host clock alone would
    time the launches)."""
    if DEVICE.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _tokens_per_step() -> int:
    return BATCH * (SEQ - 1)


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
    pin = DEVICE.startswith("cuda")
    return DataLoader(TensorDataset(_tokens(steps)), batch_size=BATCH, shuffle=True, generator=g, pin_memory=pin)


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
def _mark_warm_end(owner: Any, batch_idx: int, steps: int) -> None:
    """After the first WARM_STEPS batches, and after the last one: note when they were done (on the
    device, too), as `owner.warm_end` and `owner.last_end`."""
    if batch_idx + 1 == WARM_STEPS:
        _sync()
        owner.warm_end = time.perf_counter()
    if batch_idx + 1 == steps:
        _sync()
        owner.last_end = time.perf_counter()


def _result(
    start: float, warm_end: float | None, steps: int, final_loss: float, last_end: float | None = None
) -> dict[str, Any]:
    """Overall: from `start` to now (setup, every step and the end of the run). Steady: from `warm_end` to
    `last_end`, the end of the last step (now, when not given): the steps after the first WARM_STEPS."""
    end = time.perf_counter()
    seconds = end - start
    out = {"seconds": seconds, "final_loss": final_loss, "tokens_per_s": steps * _tokens_per_step() / seconds}
    if warm_end is not None:
        out["steady_tokens_per_s"] = (steps - WARM_STEPS) * _tokens_per_step() / ((last_end or end) - warm_end)
    return out


def run_plain(steps: int) -> dict[str, Any]:
    import contextlib

    import torch

    start = time.perf_counter()
    torch.manual_seed(0)
    loader, model = _data(steps), _model().to(DEVICE)
    if COMPILE:
        model = torch.compile(model)
    opt = _optimizer(model.parameters())
    autocast = (
        (lambda: torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16)) if BF16 else contextlib.nullcontext
    )
    n, warm_end = 0, None
    for (tokens,) in loader:
        tokens = tokens.to(DEVICE, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        n += 1
        if n == WARM_STEPS:
            _sync()
            warm_end = time.perf_counter()
    _sync()
    assert n == steps, n
    return _result(start, warm_end, steps, loss.item())


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

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            _mark_warm_end(self, batch_idx, steps)

    root = tempfile.mkdtemp(prefix="dream-bench-lm-")
    start = time.perf_counter()
    torch.manual_seed(0)
    config = DreamTrainerConfig(
        n_epochs=1, seed=None, device=DEVICE, root_dir=root, loggers=[], enable_progress_bar=False,
        enable_checkpointing=False, print_epoch_summary=False, mixed_precision="bf16" if BF16 else None,
        compile_model=COMPILE,
    )  # fmt: skip
    trainer = Bench(config)
    trainer.warm_end = trainer.last_end = None
    trainer.fit()
    _sync()
    assert trainer.global_step == steps, trainer.global_step
    result = _result(start, trainer.warm_end, steps, trainer.last_loss.item(), trainer.last_end)
    shutil.rmtree(root, ignore_errors=True)
    return result


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

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            _mark_warm_end(self, batch_idx, steps)

        def configure_optimizers(self) -> Any:
            return _optimizer(self.parameters())

    root = tempfile.mkdtemp(prefix="dream-bench-lm-lightning-")
    start = time.perf_counter()
    torch.manual_seed(0)
    loader, module = _data(steps), LitLM()
    module.warm_end = module.last_end = None
    if COMPILE:  # Lightning's documented way: compile the model before fit
        module.model = torch.compile(module.model)
    trainer = pl.Trainer(
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        max_epochs=1, accelerator="cuda" if DEVICE.startswith("cuda") else "cpu", devices=1, default_root_dir=root,
        precision="bf16-mixed" if BF16 else "32-true",
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    _sync()
    assert trainer.global_step == steps, trainer.global_step
    result = _result(start, module.warm_end, steps, module.last_loss.item(), module.last_end)
    shutil.rmtree(root, ignore_errors=True)
    return result


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
def _setup_argv() -> list[str]:
    """This worker's settings as arguments, for the processes it starts."""
    argv = ["--d-model", str(D_MODEL), "--layers", str(LAYERS), "--batch", str(BATCH), "--device", DEVICE]
    argv += ["--warm-steps", str(WARM_STEPS)]
    return argv + ["--bf16"] * BF16 + ["--compile"] * COMPILE


def worker_argv(case: str, steps: int) -> list[str]:
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--worker", case, "--steps", str(steps), *_setup_argv()]


def measure(
    cases: list[str] | tuple[str, ...] = CASES, rounds: int = 5, steps: int = DEFAULT_STEPS, warmup: bool = False
) -> dict[str, Any]:
    s = _suite()
    assert cases and cases[0] == "plain", "the plain loop is the baseline: list it first"
    runs = s.interleave({c: worker_argv(c, steps) for c in cases}, rounds, warmup=warmup, label="transformer")
    out = {
        key: {c: [r[key] for r in v] for c, v in runs.items()}
        for key in ("seconds", "final_loss", "tokens_per_s", "steady_tokens_per_s")
        if key in runs["plain"][0]
    }
    return {**out, "torch_threads": runs["plain"][0]["torch_threads"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--device", default="cpu", help='"cpu" or "cuda" (every case)')
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (every case, through its own switch)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (every case)")
    p.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    p.add_argument("--d-model", type=int, default=D_MODEL, help="model width (heads: 4; MLP: 4x)")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--warm-steps", type=int, default=0, help="also report tokens/s after the first K steps")
    p.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 0 <= args.warm_steps < args.steps:
        p.error(f"--warm-steps {args.warm_steps}: must be at least 0 and below --steps ({args.steps})")
    _configure(args)
    if args.worker:
        worker(args.worker, args.steps)
        return {}
    s = _suite()
    cases = [c for c in CASES if s.lightning_version() or c not in LIGHTNING_CASES]
    raw = measure(cases, args.rounds, args.steps, warmup=args.rounds > 1)
    steady = "steady_tokens_per_s" in raw
    print(f"transformer LM ({describe(args.steps)}), {args.rounds} interleaved round(s), fresh processes")
    print(
        "| case | median s | ratio to plain | tokens/s | final loss |"
        + (" steady tokens/s | ratio |" if steady else "")
    )
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if steady else ""))
    for c in cases:
        secs = raw["seconds"][c]
        r = s.median_ratio(secs, raw["seconds"]["plain"])
        rate_all, loss = statistics.median(raw["tokens_per_s"][c]), raw["final_loss"][c][-1]
        row = f"| {LABELS[c]} | {statistics.median(secs):.3f} | {r:.3f}x | {rate_all:,.0f} | {loss:.3f} |"
        if steady:
            rate = raw["steady_tokens_per_s"]
            # a rate: plain / case, so that above 1.0x means slower, as for the times
            rr = s.median_ratio(rate["plain"], rate[c])
            row += f" {statistics.median(rate[c]):,.0f} | {rr:.3f}x |"
        print(row)
    return raw


if __name__ == "__main__":
    main()
