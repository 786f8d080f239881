"""A tiny GPT trained with 2-D parallelism (FSDP2 x tensor parallel) on a device mesh, from one command.

    torchrun --standalone --nproc_per_node 4 examples/gpt_2d.py                    # dp_shard=2 x tp=2, ~40 s
    torchrun --standalone --nproc_per_node 4 examples/gpt_2d.py --tp 2 --pp 2      # tp=2 x pipeline=2
    torchrun --standalone --nproc_per_node 4 examples/gpt_2d.py --dp-replicate 2   # 2 replicas (DDP) x tp=2
    torchrun --standalone --nproc_per_node 4 examples/gpt_2d.py --meta-init --activation-checkpointing
    python examples/gpt_2d.py --tp 1                                               # one process, no mesh

The data is char_lm's (`load_text` and `Corpus` are imported from examples/char_lm.py): the Zen of
Python and the source of a few standard-library modules, about 100 KB, the last 10% held out for
validation. Nothing is downloaded.

The model is an `nn.Sequential` (so `--pp` can split it with the trainer's default pipeline split):
token + position embeddings, `--layers` pre-norm blocks, each with explicit causal attention (separate
`q`, `k`, `v` and `proj` Linears around `F.scaled_dot_product_attention`) and an MLP (`fc1`, GELU,
`fc2`), then a final LayerNorm and the head over the vocabulary.

What the trainer does with it (strategy "auto" picks "model_parallel" as soon as a degree beyond
dp_shard is set):
- builds the world mesh from the degrees: `--dp-replicate x --dp-shard x --pp x --tp` must equal
  WORLD_SIZE (`--dp-shard -1`, the default, takes the processes the others leave);
- calls `apply_tensor_parallel(tp_mesh)`, overridden below: q, k, v and fc1 are split column-wise
  (each TP rank computes `n_heads / tp` heads and a slice of the MLP's hidden units), proj and fc2
  row-wise (their partial outputs are summed across the TP ranks). Attention then runs on the LOCAL
  head count, which the override sets on every attention module;
- splits the blocks into pipeline stages (`--pp`), checkpoints activations (`--activation-checkpointing`),
  shards every model with FSDP2 over the data-parallel ranks, and with `--meta-init` builds the model
  on the meta device and allocates only each rank's shards before `init_weights()` fills them;
- gives each data-parallel rank its own slice of every global batch: the ranks of one TP group read
  the same batch (`self.dp_world_size` is the number of different batches per step, used below to
  size the per-rank batch); clips gradients at `gradient_clip_val` with the norm taken over the right
  meshes (the TP-sharded gradients on ("dp_shard", "tp"), the others on "dp_shard" alone, each mesh's
  gradients scaled apart); writes sharded DCP checkpoints.

Rank 0 prints the mesh, which data-parallel rank each process is, the untrained validation loss, the
training and validation loss of every epoch, and the final line `done: val loss A -> B ...`. Started with
plain `python` while its flags ask for several processes, it prints the torchrun command to use and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from dream_trainer import DreamTrainer, DreamTrainerConfig

# char_lm.py is a script beside this one, not a package: make its folder importable to reuse its data.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from char_lm import MODULES, Corpus, load_text


# --------------------------------------------------------------------------------------------------
# Model: an nn.Sequential of (embeddings, blocks..., head)
# --------------------------------------------------------------------------------------------------
class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.n_heads = n_heads  # heads computed by THIS rank: apply_tensor_parallel divides it by tp
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism q/k/v are column-sharded: their outputs are this rank's
        # n_heads * head_dim channels (d_model / tp), so the views use the local head count.
        q, k, v = (lin(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        # proj is row-sharded: it takes this rank's heads and all-reduces the partial sums.
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def build_gpt(vocab_size: int, block_size: int, d_model: int, n_heads: int, n_layers: int) -> nn.Sequential:
    """`(B, T)` ids -> `(B, T, vocab)` logits. Children "0" (embeddings), "1".."n_layers" (blocks), head."""
    blocks = [Block(d_model, n_heads) for _ in range(n_layers)]
    return nn.Sequential(Embeddings(vocab_size, block_size, d_model), *blocks, Head(d_model, vocab_size))


# --------------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------------
@dataclass
class GPT2DConfig(DreamTrainerConfig):
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    block_size: int = 64
    stride: int = 64  # training windows every `stride` characters
    batch_size: int = 32  # GLOBAL: split over the data-parallel ranks
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    verbose: bool = True  # this example's own per-epoch lines (rank 0)


class GPT2DTrainer(DreamTrainer):
    config: GPT2DConfig

    def __init__(self, config: GPT2DConfig, corpus: Corpus) -> None:
        super().__init__(config)
        self.corpus = corpus
        self.train_set = Corpus.windows(corpus.train_ids, config.block_size, config.stride)
        self.val_set = Corpus.windows(corpus.val_ids, config.block_size, config.block_size)
        self.loss_before = float("nan")
        self.history: list[dict[str, float]] = []
        self.epoch_val_loss: float | None = None  # this epoch's validation loss, once it has run

    # --- the model and how it is split ---------------------------------------------------------------
    def configure_models(self) -> None:
        # With init_device="meta" this runs under torch.device("meta"): shapes only, no memory.
        cfg = self.config
        self.model = build_gpt(self.corpus.vocab_size, cfg.block_size, cfg.d_model, cfg.n_heads, cfg.n_layers)

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        """Called with the "tp" sub-mesh when tensor_parallel > 1, before pipeline split and FSDP."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp = tp_mesh.size()
        plan: dict[str, Any] = {}
        for name, block in self.model.named_children():
            if not isinstance(block, Block):
                continue  # embeddings and head stay whole on every TP rank (FSDP still shards them)
            if block.attn.n_heads % tp:
                raise ValueError(f"n_heads={block.attn.n_heads} cannot be split over tensor_parallel={tp} ranks")
            block.attn.n_heads //= tp  # each TP rank computes its own n_heads / tp heads
            plan.update(
                {
                    f"{name}.attn.q": ColwiseParallel(),
                    f"{name}.attn.k": ColwiseParallel(),
                    f"{name}.attn.v": ColwiseParallel(),
                    f"{name}.attn.proj": RowwiseParallel(),
                    f"{name}.mlp.fc1": ColwiseParallel(),
                    f"{name}.mlp.fc2": RowwiseParallel(),
                }
            )
        parallelize_module(self.model, tp_mesh, plan)

    # --- optimizer, data, steps ----------------------------------------------------------------------
    def total_steps(self) -> int:
        cfg = self.config
        steps = (len(self.train_set) // cfg.batch_size) * (cfg.n_epochs or 1)
        return min(steps, cfg.max_steps) if cfg.max_steps else steps

    def configure_optimizers(self) -> None:
        cfg = self.config
        # Built after sharding: the parameters are DTensors (their .dim() is the whole tensor's).
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.95))
        total, warmup = self.total_steps(), min(cfg.warmup_steps, self.total_steps() // 2)

        def warmup_cosine(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_cosine)

    @property
    def per_rank_batch(self) -> int:
        """The global batch cut into one slice per data-parallel rank (TP/PP ranks share a slice)."""
        if self.config.batch_size % self.dp_world_size:
            raise ValueError(
                f"--batch-size {self.config.batch_size} is not a multiple of {self.dp_world_size} dp ranks"
            )
        return self.config.batch_size // self.dp_world_size

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        # Plain loaders: the trainer adds a DistributedSampler over the data-parallel ranks.
        # drop_last keeps every batch the same shape (a pipeline splits batches into micro-batches).
        bs = self.per_rank_batch
        train = DataLoader(self.train_set, batch_size=bs, shuffle=True, drop_last=True)
        return train, DataLoader(self.val_set, batch_size=bs, drop_last=True)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch, batch_idx):
        x, y = batch
        # loss(model(x), y) without a pipeline; with one, the schedule runs forward and backward.
        return {"loss": self.pipeline_forward(x, y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return {"val_loss": self.pipeline_forward(x, y)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss, outside the trainer's validation (a collective: every rank calls it).
        Each data-parallel rank scores its own whole batches of the validation windows."""
        bs, dp = self.per_rank_batch, self.dp_world_size
        n = len(self.val_set) // (bs * dp) * bs  # windows per dp rank
        mine = Subset(self.val_set, range(self.dp_rank * n, (self.dp_rank + 1) * n))
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros(2, device=self.device)
        for x, y in DataLoader(mine, batch_size=bs):
            loss = self.pipeline_forward(x.to(self.device), y.to(self.device))
            total += torch.stack([loss.detach().float() * len(x), torch.tensor(float(len(x)), device=self.device)])
        self.model.train(was_training)
        self.all_reduce(total, op="sum")  # TP/PP ranks count their dp rank's batches again: the mean holds
        return float(total[0] / total[1])

    # --- reporting (rank 0) --------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        self.loss_before = self.evaluate()
        ranks = self.all_gather_object(self.dp_rank)
        if self.is_global_zero and self.config.verbose:
            n_params = sum(p.numel() for p in self.model.parameters())  # DTensor numel: the whole tensor
            print(f"{self.world_size} process(es), strategy {self.strategy}: {self.parallel!r}")
            print(f"data-parallel rank of each process: {ranks} (equal ranks read the same batches)")
            print(
                f"{len(self.corpus.train_ids):,} training characters, vocabulary {self.corpus.vocab_size}, "
                f"{n_params:,} parameters, global batch {self.config.batch_size} ({self.per_rank_batch} per dp "
                f"rank), {self.total_steps()} steps | untrained val loss {self.loss_before:.3f}",
                flush=True,
            )

    def on_train_epoch_start(self) -> None:
        self.epoch_val_loss = None

    def on_validation_end(self) -> None:
        # callback_metrics are averaged over the ranks already.
        self.epoch_val_loss = float(self.callback_metrics["val_loss"])

    def on_train_epoch_end(self) -> None:
        self.record_epoch()  # after this epoch's validation

    def on_train_end(self) -> None:
        # When --max-steps stops training inside an epoch, that is no epoch end (a run continued from the
        # final checkpoint ends it): no on_train_epoch_end, no epoch-end validation. Record it here instead.
        if self.loop.epoch_in_progress:
            self.record_epoch()

    def record_epoch(self) -> None:
        # Without a validation in the epoch (a stop inside it), score the final weights here.
        val_loss = self.epoch_val_loss if self.epoch_val_loss is not None else self.evaluate()
        row = {"epoch": self.current_epoch + 1, "loss": float(self.callback_metrics["loss"]), "val_loss": val_loss}
        self.history.append(row)
        if self.is_global_zero and self.config.verbose:
            print(
                f"epoch {row['epoch']} | step {self.global_step} | loss {row['loss']:.3f} | "
                f"val loss {row['val_loss']:.3f}",
                flush=True,
            )


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = GPT2DConfig()
    p = argparse.ArgumentParser(description="A tiny GPT on a device mesh: FSDP2 x tensor (x pipeline) parallel.")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: %(default)s)")
    p.add_argument(
        "--dp-shard", type=int, default=-1, help="FSDP degree; -1: the processes left (default: %(default)s)"
    )
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas, HSDP with dp-shard (default: %(default)s)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default: %(default)s)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b"), default="1f1b", help="(default: %(default)s)")
    p.add_argument("--meta-init", action="store_true", help="build on the meta device, allocate only the shards")
    p.add_argument(
        "--activation-checkpointing", nargs="?", const="full", choices=("full", "selective"), default=None,
        help="recompute activations per block in backward (bare flag: full)",
    )  # fmt: skip
    p.add_argument("--epochs", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: none)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.learning_rate, help="peak learning rate (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="(default: %(default)s)")
    p.add_argument("--heads", type=int, default=d.n_heads, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=d.n_layers, help="(default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="context length (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--root-dir", default="runs/gpt_2d", help="(default: %(default)s)")
    p.add_argument("--metrics-out", default=None, help="rank 0 writes the returned metrics here as JSON")
    p.add_argument("--quiet", action="store_true", help="print only the final line")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU per process if any")
    return p.parse_args(argv)


def launch_hint(args: argparse.Namespace, argv: list[str]) -> str | None:
    """The one line to print when this script runs without torchrun (one process) but its flags ask for
    a mesh of several processes: how many, and the command. None when it can run as it was started
    (under torchrun the trainer checks the degrees against WORLD_SIZE itself)."""
    fixed = args.dp_replicate * args.tp * args.pp * max(args.dp_shard, 1)
    if "WORLD_SIZE" in os.environ or fixed == 1:
        return None
    # --dp-shard -1 takes the processes the other degrees leave: launch two shards beside them (the
    # documented 4 processes, dp_shard=2 x tp=2), or as many as they need when they are 4 or more.
    n = fixed if args.dp_shard > 0 or fixed >= 4 else 2 * fixed
    command = ["torchrun", "--standalone", "--nproc_per_node", str(n), os.path.relpath(__file__), *argv]
    return f"gpt_2d.py needs {n} processes: {shlex.join(command)}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return (on every rank) val_loss_before, val_loss, loss, history (per epoch), global_step,
    world_size, strategy, mesh, dp_ranks (per process), wall_s."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    hint = launch_hint(args, argv)
    if hint is not None:
        print(hint, file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    corpus = Corpus(load_text(MODULES))
    config = GPT2DConfig(
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        pipeline_schedule=args.pp_schedule,
        init_device="meta" if args.meta_init else None,
        device=args.device,
        activation_checkpointing=args.activation_checkpointing,
        n_epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        block_size=args.block_size,
        scheduler_interval="step",
        gradient_clip_val=1.0,  # the total norm over every mesh and pipeline stage
        num_sanity_val_steps=0,
        root_dir=args.root_dir,
        loggers=[],
        print_epoch_summary=False,  # record_epoch prints instead (at epoch ends and a stop inside an epoch)
        enable_progress_bar=False,
        verbose=not args.quiet,
    )
    trainer = GPT2DTrainer(config, corpus)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # FSDP2 warns when a wrapped module returns a view (a Linear applied to (B, T, d) does) because
        # an in-place op on it would skip a hook; nothing here modifies the logits in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
        trainer.fit()
    wall = time.perf_counter() - start

    dp_ranks = trainer.all_gather_object(trainer.dp_rank)  # a collective: every rank calls it
    mesh = trainer.device_mesh
    results: dict[str, Any] = {
        "val_loss_before": trainer.loss_before,
        "val_loss": trainer.history[-1]["val_loss"],
        "loss": float(trainer.callback_metrics["loss"]),
        "history": trainer.history,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "strategy": trainer.strategy,
        "mesh": {} if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
        "dp_ranks": dp_ranks,
        "wall_s": wall,
    }
    if trainer.is_global_zero:
        print(
            f"done: val loss {results['val_loss_before']:.3f} -> {results['val_loss']:.3f} nats/char | "
            f"{trainer.world_size} process(es), mesh {results['mesh'] or 'none'} | {trainer.global_step} steps | "
            f"{wall:.1f}s",
            flush=True,
        )
        if not args.quiet:
            kind = "sharded DCP directories" if trainer.sharded_checkpoints else "files"
            print(f"checkpoints ({kind}): {trainer.checkpoint_dir}")
        if args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
