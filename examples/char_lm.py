"""A small character-level transformer language model, trained on text that ships with Python itself.

    python examples/char_lm.py                          # ~1 min on 2 CPU cores
    python examples/char_lm.py --precision bf16 --epochs 5
    python examples/char_lm.py --max-steps 50 --sample-len 100

The text: the Zen of Python (`import this`, stored ROT13-encoded in the `this` module) followed by the
source code of a few standard-library modules (`inspect.getsource`), about 100 KB. Nothing is
downloaded. The last 10% is held out for validation; the vocabulary is the set of characters seen.

The model: token and position embeddings, a stack of pre-norm `nn.TransformerEncoderLayer`s made
causal with a triangular attention mask (each position sees only itself and earlier characters), a
final LayerNorm and a linear head over the vocabulary: a tiny GPT.

The training recipe: AdamW (no weight decay on biases and LayerNorm weights), a learning rate that
warms up linearly and then follows a cosine, stepped after every optimizer step
(`scheduler_interval="step"`), gradient clipping at norm 1 (`gradient_clip_val`), optional bf16
autocast (`--precision bf16`). It prints the loss and the perplexity per epoch (perplexity =
exp(loss): the model is, on average, as unsure of the next character as a uniform choice among that
many; an untrained model scores about the vocabulary size), then a generated sample.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import inspect
import io
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig

MODULES = ("textwrap", "heapq", "functools", "string", "queue")


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
def load_text(modules: tuple[str, ...] = MODULES) -> str:
    """The Zen of Python and the source of `modules` (those whose source is installed)."""
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        import this
    parts = [codecs.decode(this.s, "rot13")]
    for name in modules:
        try:
            parts.append(inspect.getsource(importlib.import_module(name)))
        except (OSError, TypeError):  # an installation without .py sources: the Zen still works
            continue
    return "\n\n".join(parts)


class Corpus:
    """A text as integer ids, its vocabulary, and (input, next-character target) windows."""

    def __init__(self, text: str, val_fraction: float = 0.1) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        split = int(len(ids) * (1 - val_fraction))
        self.train_ids, self.val_ids = ids[:split], ids[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s if c in self.stoi]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    @staticmethod
    def windows(ids: torch.Tensor, block_size: int, stride: int) -> TensorDataset:
        """Windows of `block_size + 1` characters every `stride`: x is the first block_size, y the last."""
        if len(ids) <= block_size:
            raise ValueError(f"a text of {len(ids)} characters is too short for --block-size {block_size}")
        w = ids.unfold(0, block_size + 1, stride)  # (n_windows, block_size + 1), a view: no copy
        return TensorDataset(w[:, :-1], w[:, 1:])


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
class TinyGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, d_model: int, n_heads: int, n_layers: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=dropout, activation="gelu", batch_first=True,
            norm_first=True,  # pre-norm, as GPT-2: trains stably without a long warmup
        )  # fmt: skip
        # enable_nested_tensor=False: the padding fast path does not apply to a causal model (and warns).
        self.blocks = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """`idx: (B, T)` character ids -> logits `(B, T, vocab)` for the character after each position."""
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        # -inf above the diagonal: position i attends to positions <= i only. is_causal=True lets
        # attention use its causal kernels; the mask must still be given.
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


# --------------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------------
@dataclass
class CharLMConfig(DreamTrainerConfig):
    learning_rate: float = 1e-2  # high for a transformer, but the model is tiny and the run short
    weight_decay: float = 0.1
    warmup_steps: int = 30
    block_size: int = 64
    stride: int = 32  # training windows overlap by half: twice the windows per epoch
    batch_size: int = 32
    d_model: int = 96
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0  # a run this short underfits: dropout would only slow it down
    verbose: bool = True  # this example's own per-epoch lines (the trainer's summary is turned off)


class CharLMTrainer(DreamTrainer):
    config: CharLMConfig

    def __init__(self, config: CharLMConfig, corpus: Corpus) -> None:
        super().__init__(config)
        self.corpus = corpus
        self.train_set = Corpus.windows(corpus.train_ids, config.block_size, config.stride)
        # Validation windows do not overlap: every held-out character is scored once.
        self.val_set = Corpus.windows(corpus.val_ids, config.block_size, config.block_size)
        self.loss_before = float("nan")

    def configure_models(self) -> None:
        cfg = self.config
        self.model = TinyGPT(
            self.corpus.vocab_size, cfg.block_size, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.dropout
        )

    def total_steps(self) -> int:
        cfg = self.config
        steps = math.ceil(len(self.train_set) / cfg.batch_size) * (cfg.n_epochs or 1)
        return min(steps, cfg.max_steps) if cfg.max_steps else steps

    def configure_optimizers(self) -> None:
        cfg = self.config
        # Decay matrices (linear and embedding weights), not biases or LayerNorm gains.
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.95))
        total, warmup = self.total_steps(), min(cfg.warmup_steps, self.total_steps() // 2)

        def warmup_cosine(step: int) -> float:  # a factor on the peak LR
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine down to 10% of peak

        # Stepped after every optimizer step, because config.scheduler_interval == "step".
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine)

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        cfg = self.config
        return DataLoader(self.train_set, batch_size=cfg.batch_size, shuffle=True), DataLoader(
            self.val_set, batch_size=128
        )

    def lm_loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        return {"loss": self.lm_loss(batch)}  # the trainer runs backward, clipping, step, scheduler

    def validation_step(self, batch, batch_idx):
        return {"val_loss": self.lm_loss(batch)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss per character, outside the trainer's validation (no logging)."""
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for x, y in DataLoader(self.val_set, batch_size=128):
            with self.autocast():
                logits = self.model(x.to(self.device))
            total += F.cross_entropy(logits.flatten(0, 1).float(), y.to(self.device).flatten(), reduction="sum").item()
            count += y.numel()
        self.model.train(was_training)
        return total / count

    def on_fit_start(self) -> None:
        self.loss_before = self.evaluate()
        if self.config.verbose:
            print(
                f"{len(self.corpus.train_ids):,} training and {len(self.corpus.val_ids):,} validation characters, "
                f"vocabulary {self.corpus.vocab_size}, {sum(p.numel() for p in self.model.parameters()):,} "
                f"parameters, {self.total_steps()} steps | untrained val loss {self.loss_before:.3f} "
                f"(perplexity {math.exp(self.loss_before):.1f})"
            )

    def on_train_epoch_end(self) -> None:
        # Fires after this epoch's validation: callback_metrics has the epoch's mean training loss
        # and the validation loss.
        m, lr = self.callback_metrics, self.scheduler.get_last_lr()[0]
        if self.config.verbose:
            print(
                f"epoch {self.current_epoch + 1} | step {self.global_step} | lr {lr:.2e} | "
                f"train loss {m['loss']:.3f} (perplexity {math.exp(m['loss']):.2f}) | "
                f"val loss {m['val_loss']:.3f} (perplexity {math.exp(m['val_loss']):.2f})",
                flush=True,
            )

    @torch.no_grad()
    def generate(self, prompt: str, n_chars: int, temperature: float = 0.8, seed: int = 0) -> str:
        """`n_chars` characters sampled after `prompt` (characters outside the vocabulary are dropped)."""
        was_training = self.model.training
        self.model.eval()
        g = torch.Generator(device=self.device).manual_seed(seed)
        ids = torch.tensor([self.corpus.encode(prompt) or [0]], device=self.device)
        out: list[int] = []
        for _ in range(n_chars):
            with self.autocast():
                logits = self.model(ids[:, -self.config.block_size :])[0, -1].float()
            nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=g)
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            out.append(int(nxt))
        self.model.train(was_training)
        return self.corpus.decode(out)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = CharLMConfig()
    p = argparse.ArgumentParser(description="A character-level transformer LM on Python's own text.")
    p.add_argument("--epochs", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: none)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    p.add_argument("--lr", type=float, default=defaults.learning_rate, help="peak learning rate (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=defaults.block_size, help="context length (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=defaults.d_model, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=defaults.n_layers, help="(default: %(default)s)")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="(default: %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="(default: %(default)s)")
    p.add_argument("--modules", nargs="*", default=list(MODULES), help="stdlib modules whose source is the text")
    p.add_argument("--prompt", default="def ", help="start of the generated sample (default: %(default)r)")
    p.add_argument("--sample-len", type=int, default=300, help="characters to generate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--root-dir", default="runs/char_lm", help="(default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="print only the final line and the sample")
    # Splitting ops this small across threads costs more than it saves (and oversubscribes shared CPUs).
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train; return val_loss_before, val_loss, perplexity, global_step, vocab_size, sample, wall_s."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    corpus = Corpus(load_text(tuple(args.modules)))
    config = CharLMConfig(
        n_epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        block_size=args.block_size,
        d_model=args.d_model,
        n_layers=args.layers,
        dropout=args.dropout,
        mixed_precision=None if args.precision == "fp32" else args.precision,
        scheduler_interval="step",
        gradient_clip_val=1.0,
        root_dir=args.root_dir,
        print_epoch_summary=False,  # the hooks above print lines with perplexity and LR instead
        verbose=not args.quiet,
        enable_progress_bar=not args.quiet,
    )
    trainer = CharLMTrainer(config, corpus)
    start = time.perf_counter()
    trainer.fit()
    if "val_loss" not in trainer.callback_metrics:  # max_steps ended training mid-epoch: no epoch-end validation
        trainer.validate()
    wall = time.perf_counter() - start

    val_loss = float(trainer.callback_metrics["val_loss"])
    sample = trainer.generate(args.prompt, args.sample_len, seed=args.seed)
    print(
        f"done: val loss {trainer.loss_before:.3f} -> {val_loss:.3f} nats/char (perplexity "
        f"{math.exp(trainer.loss_before):.1f} -> {math.exp(val_loss):.2f}) | {trainer.global_step} steps | {wall:.1f}s"
    )
    print(f"sample ({args.precision}, temperature 0.8):\n{args.prompt}{sample}")
    return {
        "val_loss_before": trainer.loss_before,
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "global_step": trainer.global_step,
        "vocab_size": corpus.vocab_size,
        "sample": sample,
        "wall_s": wall,
    }


if __name__ == "__main__":
    main()
