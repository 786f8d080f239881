"""Pretrain a small GPT from a token file on disk, by steps, resumable: the shape of a language-model run.

    python examples/gpt_tokens.py                          # 200 steps, ~15 s on 2 CPU cores
    python examples/gpt_tokens.py --max-steps 300 --resume # goes on from the last checkpoint to step 300

What it does:

1. writes the data as nanoGPT does (`train.bin`, `val.bin`: raw uint16 token ids) into `--data-dir`
   (a temporary directory by default): generated English-like sentences from a tiny grammar, encoded
   as bytes (a vocabulary of 256);
2. reads `train.bin` with `dream_trainer.data.TokenDataset`: memory-mapped, windows of `--seq-len`
   tokens in a seeded random order per pass, `infinite=True` so the loader never ends and `max_steps`
   says how long to train; through torchdata's `StatefulDataLoader` with `--workers` loader workers,
   whose position the checkpoints hold, so a resumed run reads exactly the windows the uninterrupted
   one would have read. Under `torchrun` each data-parallel rank reads its own windows: the trainer
   tells the dataset its rank;
3. trains a small GPT (token and position embeddings, causal pre-norm transformer blocks, a linear head)
   with AdamW and a warmup + cosine learning rate per step, validating on windows of `val.bin`
   (`TokenWindows`, map-style) every `--val-every` steps and saving a checkpoint every `--ckpt-every`;
4. `--resume` continues the run in `--root-dir` from its newest checkpoint (`fit(ckpt_path="last")`).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.callbacks import ModelCheckpoint
from dream_trainer.data import TokenDataset, TokenWindows

VOCAB = 256  # tokens are bytes


# --------------------------------------------------------------------------------------------------
# Data: a token file on disk
# --------------------------------------------------------------------------------------------------
def generate_text(n_sentences: int, seed: int) -> str:
    """Sentences of a tiny grammar: regular enough for a small model to learn in a few hundred steps."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child"]
    verbs = ["sat on", "ran to", "looked at", "jumped over", "walked past", "sang to"]
    objects = ["the mat", "the park", "a tree", "the river", "the house", "a red ball"]
    endings = [".", ".", ".", "!", " again."]
    return " ".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}{rng.choice(endings)}"
        for _ in range(n_sentences)
    )


def write_token_file(path: Path, text: str) -> int:
    """`text` as uint16 byte ids in nanoGPT's `.bin` layout; returns the number of tokens."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    ids.tofile(path)
    return len(ids)


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, seq_len: int, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


# --------------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------------
@dataclass
class GPTTokensConfig(DreamTrainerConfig):
    data_dir: str = ""
    seq_len: int = 64
    batch_size: int = 16
    workers: int = 2
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 200  # the length of the cosine: keep it when resuming to more steps
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2


class GPTTokensTrainer(DreamTrainer):
    config: GPTTokensConfig

    def configure_models(self) -> None:
        cfg = self.config
        self.model = GPT(cfg.seq_len, cfg.d_model, cfg.n_heads, cfg.n_layers)

    def configure_optimizers(self) -> None:
        cfg = self.config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.95))

        def warmup_cosine(step: int) -> float:
            if step < cfg.warmup_steps:
                return (step + 1) / cfg.warmup_steps
            progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine)

    def configure_dataloaders(self) -> tuple[StatefulDataLoader, DataLoader]:
        cfg = self.config
        data = Path(cfg.data_dir)
        train = TokenDataset(data / "train.bin", cfg.seq_len, shuffle=True, seed=cfg.seed or 0, infinite=True)
        val = TokenWindows(data / "val.bin", cfg.seq_len)
        return (
            StatefulDataLoader(train, batch_size=cfg.batch_size, num_workers=cfg.workers),
            DataLoader(val, batch_size=64),
        )

    def lm_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch, batch_idx):
        return {"loss": self.lm_loss(batch)}

    def validation_step(self, batch, batch_idx):
        return {"val_loss": self.lm_loss(batch)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = GPTTokensConfig()
    p = argparse.ArgumentParser(description="Pretrain a small GPT from a token file, by steps, resumable.")
    p.add_argument("--max-steps", type=int, default=200, help="train until this step (default: %(default)s)")
    p.add_argument("--total-steps", type=int, default=d.total_steps, help="LR schedule length (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="(default: %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers, help="loader workers (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.learning_rate, help="peak learning rate (default: %(default)s)")
    p.add_argument("--val-every", type=int, default=100, help="validate every N steps (default: %(default)s)")
    p.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N steps (default: %(default)s)")
    p.add_argument("--sentences", type=int, default=20_000, help="size of the generated text (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="where train.bin/val.bin go (default: a temporary directory)")
    p.add_argument("--root-dir", default="runs/gpt_tokens", help="(default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue the run in --root-dir from its last checkpoint")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="print only the final line")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Train; return val_loss_before, val_loss, global_step, tokens, wall_s and the trained model."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(args.data_dir or tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        tokens = write_token_file(data_dir / "train.bin", generate_text(args.sentences, seed=args.seed))
        write_token_file(data_dir / "val.bin", generate_text(max(100, args.sentences // 20), seed=args.seed + 1))
        config = GPTTokensConfig(
            data_dir=str(data_dir),
            max_steps=args.max_steps,
            total_steps=args.total_steps,
            seed=args.seed,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            workers=args.workers,
            learning_rate=args.lr,
            scheduler_interval="step",
            gradient_clip_val=1.0,
            val_every_n_steps=args.val_every,
            val_every_n_epochs=None,
            num_sanity_val_steps=0,
            log_every_n_steps=args.val_every,
            root_dir=args.root_dir,
            print_epoch_summary=False,
            enable_progress_bar=not args.quiet,
            callbacks=[ModelCheckpoint(every_n_train_steps=args.ckpt_every, save_last=True)],
        )
        trainer = GPTTokensTrainer(config)
        start = time.perf_counter()
        trainer.fit(ckpt_path="last" if args.resume else None)
        wall = time.perf_counter() - start
        val_loss = float(trainer.callback_metrics["val_loss"])
    print(
        f"{tokens:,} training tokens | step {trainer.global_step} | val loss {val_loss:.3f} "
        f"(perplexity {math.exp(val_loss):.2f}; untrained: {VOCAB}) | {wall:.1f} s"
    )
    return {"val_loss": val_loss, "global_step": trainer.global_step, "tokens": tokens, "wall_s": wall,
            "model": trainer.model}  # fmt: skip


if __name__ == "__main__":
    main()
