"""A plain PyTorch training program ports exactly: the pieces, then a GPT trained nanoGPT-style.

Each piece is what a plain loop does that a trainer could do differently by a few ulps or a few RNG
draws, checked `torch.equal` against the loop written by hand (fp32, one thread, fixed seed):

- `gradient_clip_val` sums the gradient norm in the model's parameter order, as
  `clip_grad_norm_(model.parameters())` does, also when the optimizer's groups (decay / no decay)
  list the parameters in another order;
- `lr_at_step(step)` writes an absolute rate into `param_group["lr"]`, as the loop does by hand;
- `val_restores_rng=False` lets validation draw from the training RNG, as a plain loop's evaluation;
- `val_at_start=True` validates before the first step, logged at step 0;
- a step-based run validates on its cadence only: not once more after `max_steps`.

The last test trains a small GPT the way nanoGPT's `train.py` does (AdamW with decay / no-decay groups,
warmup + cosine rate set every iteration, 4 accumulated micro-batches, clipping at 1.0, an evaluation
every 4 iterations and at iteration 0 that draws its batches from the global RNG, the next batch fetched
right after each forward) and its port; the weights end `torch.equal`. The variant of that loop which
draws each batch right before its forward ports exactly with a plain generator loader (which, for
nanoGPT's own order, trains other weights).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer, DreamTrainerConfig
from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.loggers import MemoryLogger

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons: the same kernels


def config(tmp_path: Path, **overrides: Any) -> DreamTrainerConfig:
    return quiet_config(tmp_path, **overrides)


def weights_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """nanoGPT's grouping: matrices decay, biases and norms do not (another order than the model's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# --- clipping: the model's parameter order ------------------------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def regression_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 16, generator=g)
    return TensorDataset(x, x[:, :4] * 3.0 + 0.1 * torch.randn(96, 4, generator=g))


class Clipped(DreamTrainer):
    def configure_models(self) -> None:
        self.model = mlp()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(decay_groups(self.model), lr=1e-2)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        return DataLoader(regression_data(), batch_size=8), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.model(x), y)


def test_clip_norm_is_clip_grad_norm_of_the_model_parameters_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = mlp()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    norms, group_order_differs = [], False
    for x, y in DataLoader(regression_data(), batch_size=8):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        in_groups = torch.nn.utils.get_total_norm([p.grad for g in optimizer.param_groups for p in g["params"]])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        group_order_differs |= not torch.equal(in_groups, norm)
        norms.append(norm)
        optimizer.step()
    assert group_order_differs  # summed in the groups' order the norm is another float: the test can fail

    class Recorder(Callback):
        def __init__(self) -> None:
            self.norms: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.norms.append(trainer.grad_norms["optimizer"])

    recorder = Recorder()
    trainer = Clipped(config(tmp_path, seed=3, gradient_clip_val=0.5, callbacks=[recorder]))
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(recorder.norms, norms, strict=True))
    assert weights_equal(trainer.model, model)


def test_clip_order_follows_param_groups_added_later(tmp_path: Path) -> None:
    class Grows(Clipped):
        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.SGD([{"params": self.model[5].parameters()}], lr=1e-2)

        def on_train_epoch_start(self) -> None:
            if self.current_epoch == 1:  # as a finetuning callback unfreezing the body
                self.optimizer.add_param_group({"params": [p for m in list(self.model)[:5] for p in m.parameters()]})

    trainer = Grows(config(tmp_path, n_epochs=2, gradient_clip_val=0.5))
    trainer.fit()
    params = trainer._clipping.params(trainer.optimizer)
    assert [id(p) for p in params] == [id(p) for p in trainer.model.parameters()]


# --- lr_at_step: an absolute rate per step ------------------------------------------------------------------------
def warmup_cosine(step: int, peak: float = 6e-3, floor: float = 6e-4, warmup: int = 3, total: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if step > total:
        return floor
    ratio = (step - warmup) / (total - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


class Scheduled(Clipped):
    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(decay_groups(self.model), lr=123.0)  # lr_at_step replaces it

    def lr_at_step(self, step: int) -> float:
        return warmup_cosine(step)


def test_lr_at_step_is_setting_param_group_lr_by_hand(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = mlp()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=123.0)
    step = 0
    for _ in range(2):
        for x, y in DataLoader(regression_data(), batch_size=8):
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(step)
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            step += 1
    trainer = Scheduled(config(tmp_path, seed=3, n_epochs=2))
    trainer.fit()
    assert weights_equal(trainer.model, model)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [warmup_cosine(24)] * 2  # the next step's rate


def test_lr_at_step_rate_is_the_one_logged_for_each_step_and_survives_a_resume(tmp_path: Path) -> None:
    from dream_trainer.callbacks import LearningRateMonitor

    memory = MemoryLogger()
    trainer = Scheduled(
        config(tmp_path, seed=3, loggers=[memory], callbacks=[LearningRateMonitor()], log_every_n_steps=1)
    )
    trainer.fit()
    logged = memory.series("lr-optimizer/pg1")
    assert logged == [(k, warmup_cosine(k)) for k in range(13)]
    path = tmp_path / "end.ckpt"
    trainer.save_checkpoint(path)
    again = Scheduled(config(tmp_path, seed=3, n_epochs=2))
    again.fit(ckpt_path=path)
    assert again.global_step == 24 and again.optimizer.param_groups[0]["lr"] == warmup_cosine(24)


def test_lr_at_step_with_a_scheduler_is_refused(tmp_path: Path) -> None:
    class Both(Scheduled):
        def configure_optimizers(self) -> None:
            super().configure_optimizers()
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 5)

    with pytest.raises(MisconfigurationError, match=r"lr_at_step and the scheduler self\.scheduler both set"):
        Both(config(tmp_path)).fit()


# --- validation and the RNG ---------------------------------------------------------------------------------------
class RandomEval(Clipped):
    """Dropout in training, and an evaluation that samples its batches from the global RNG."""

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[DataLoader, Any]:
        return DataLoader(regression_data(), batch_size=8, shuffle=True), RandomBatches()

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


class RandomBatches:
    """A plain loop's evaluation: 3 batches drawn with torch.randint from the global RNG."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = regression_data().tensors
        for _ in range(3):
            i = torch.randint(len(x), (8,))
            yield x[i], y[i]


def random_eval_loop(validate: bool) -> nn.Module:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train = DataLoader(regression_data(), batch_size=8, shuffle=True)
    for _ in range(2):
        for x, y in train:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        if validate:
            model.eval()
            with torch.no_grad():
                for x, y in RandomBatches():
                    F.mse_loss(model(x), y)
            model.train()
    return model


def test_validation_restores_the_rng_by_default_and_shares_it_when_asked(tmp_path: Path) -> None:
    restored = RandomEval(config(tmp_path, seed=5, n_epochs=2))
    restored.fit()
    assert weights_equal(restored.model, random_eval_loop(validate=False))  # as if it never validated
    shared = RandomEval(config(tmp_path, seed=5, n_epochs=2, val_restores_rng=False))
    shared.fit()
    assert weights_equal(shared.model, random_eval_loop(validate=True))  # as the loop that evaluates
    assert not weights_equal(shared.model, restored.model)


def test_sanity_check_restores_the_rng_even_when_validation_shares_it(tmp_path: Path) -> None:
    trainer = RandomEval(config(tmp_path, seed=5, n_epochs=2, val_restores_rng=False, num_sanity_val_steps=2))
    trainer.fit()
    assert weights_equal(trainer.model, random_eval_loop(validate=True))


@pytest.mark.parametrize("field", ["val_restores_rng", "val_at_start"])
def test_the_new_flags_are_checked(field: str) -> None:
    with pytest.raises(ConfigError, match=f"DreamTrainerConfig.{field} = 'yes' is invalid: expected True or False"):
        DreamTrainerConfig(**{field: "yes"})


# --- validation at step 0, and none after the last step unless due ------------------------------------------------
class ValSteps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.sanity: list[int] = []

    def on_validation_end(self, trainer: Any) -> None:
        (self.sanity if trainer.sanity_checking else self.steps).append(trainer.global_step)


class Endless:
    """An endless stream of batches (no length), as a token stream or an infinite sampler gives."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = regression_data().tensors
        while True:
            for i in range(0, 96, 8):
                yield x[i : i + 8], y[i : i + 8]


class StepBased(RandomEval):
    def configure_dataloaders(self) -> tuple[Any, Any]:
        return Endless(), DataLoader(regression_data(), batch_size=32)


def test_val_at_start_validates_at_step_0_and_logs_it(tmp_path: Path) -> None:
    seen, memory = ValSteps(), MemoryLogger()
    common: dict[str, Any] = {"val_every_n_steps": 4, "val_at_start": True, "num_sanity_val_steps": 1}
    trainer = StepBased(config(tmp_path, max_steps=10, callbacks=[seen], loggers=[memory], **common))
    trainer.fit()
    assert seen.sanity == [0] and seen.steps == [0, 4, 8]  # no validation after step 10: not due
    assert [s for s, _ in memory.series("val_loss")] == [0, 4, 8]
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    again_seen = ValSteps()
    again = StepBased(config(tmp_path, max_steps=14, callbacks=[again_seen], **common))
    again.fit(ckpt_path=path)
    assert again_seen.steps == [12]  # a run resumed after step 0 does not validate at its start


@pytest.mark.parametrize(
    ("batches", "max_steps", "expected"),
    [
        (8, 5, []),  # max_steps cuts the epoch: no epoch end, no epoch validation (as Lightning)
        (6, 6, [6]),  # the last step is the epoch's last batch: the epoch cadence validates
    ],
)
def test_epoch_validation_only_at_a_real_epoch_end(
    tmp_path: Path, batches: int, max_steps: int, expected: list
) -> None:
    class Finite(RandomEval):
        def configure_dataloaders(self) -> tuple[Any, Any]:
            return DataLoader(regression_data(), batch_size=96 // batches), DataLoader(regression_data(), batch_size=32)

    seen = ValSteps()
    Finite(config(tmp_path, max_steps=max_steps, callbacks=[seen])).fit()
    assert seen.steps == expected


# --- the proof: a GPT trained nanoGPT-style ---------------------------------------------------------------------------
VOCAB, BLOCK, EMBD, HEADS, LAYERS, DROPOUT = 24, 12, 32, 2, 2, 0.1
BATCH, ACCUM, EVAL_EVERY, EVAL_ITERS, MAX_ITERS, CLIP = 6, 4, 4, 3, 12, 1.0
LR, MIN_LR, WARMUP, DECAY_ITERS = 3e-3, 3e-4, 3, 12


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(EMBD, 3 * EMBD)
        self.proj = nn.Linear(EMBD, EMBD)
        self.attn_dropout = nn.Dropout(DROPOUT)
        self.out_dropout = nn.Dropout(DROPOUT)
        self.register_buffer("causal", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        mixed = self.attn_dropout(scores.softmax(dim=-1)) @ v
        return self.out_dropout(self.proj(mixed.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(EMBD), SelfAttention()
        self.norm2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD), nn.Dropout(DROPOUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer with tied input/output embeddings; `forward(idx, targets)`
    returns `(logits, loss)` as nanoGPT's model does."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, EMBD)
        self.positions = nn.Embedding(BLOCK, EMBD)
        self.dropout = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(EMBD)
        self.head = nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.tokens.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.dropout(self.tokens(idx) + self.positions(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def token_splits() -> dict[str, torch.Tensor]:
    """A noisy cyclic token stream from its own generator (the global RNG is the program's)."""
    g = torch.Generator().manual_seed(11)
    steps = torch.randint(1, 3, (1200,), generator=g)
    tokens = torch.cumsum(steps, 0) % VOCAB
    return {"train": tokens[:1000], "val": tokens[1000:]}


DATA = token_splits()


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = DATA[split]
    ix = torch.randint(len(data) - BLOCK, (BATCH,))  # the global RNG, as nanoGPT
    return (
        torch.stack([data[i : i + BLOCK] for i in ix.tolist()]),
        torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix.tolist()]),
    )


def get_lr(it: int) -> float:
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY_ITERS:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(decay_groups(model), lr=LR, betas=(0.9, 0.95))


@torch.no_grad()
def estimate_loss(model: nn.Module) -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(EVAL_ITERS)
        for k in range(EVAL_ITERS):
            x, y = get_batch(split)
            losses[k] = model(x, y)[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def nanogpt_loop(fetch_ahead: bool = True) -> tuple[nn.Module, dict[int, dict[str, float]]]:
    """nanoGPT's training loop, in its order of RNG draws (fp32 on the CPU: no loss scaler, no autocast).
    `fetch_ahead=False`: the common variant that draws each micro-batch right before its forward (after
    the iteration's evaluation) instead of right after the previous forward (before it)."""
    torch.manual_seed(1337)
    model = TinyGPT()
    optimizer = make_optimizer(model)
    evals = {}
    if fetch_ahead:
        x, y = get_batch("train")  # the first batch, before the loop
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % EVAL_EVERY == 0:
            evals[iter_num] = estimate_loss(model)
        for _ in range(ACCUM):
            if not fetch_ahead:
                x, y = get_batch("train")
            _, loss = model(x, y)
            loss = loss / ACCUM
            if fetch_ahead:
                x, y = get_batch("train")  # the next batch, fetched while the device would compute
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > MAX_ITERS:
            return model, evals


class TrainBatches:
    """nanoGPT's `get_batch("train")` as a loader: yields the batch fetched last; `fetch()` draws the
    next one (nanoGPT fetches it right after each forward)."""

    def __init__(self) -> None:
        self.batch = get_batch("train")

    def fetch(self) -> None:
        self.batch = get_batch("train")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.batch


class EvalBatches:
    """nanoGPT's `estimate_loss` batches: EVAL_ITERS of each split, drawn from the global RNG."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for split in ("train", "val"):
            for _ in range(EVAL_ITERS):
                x, y = get_batch(split)
                yield {"split": split, "x": x, "y": y}


class NanoGPTPort(DreamTrainer):
    def configure_models(self) -> None:
        self.model = TinyGPT()

    def configure_optimizers(self) -> None:
        self.optimizer = make_optimizer(self.model)

    def configure_dataloaders(self) -> tuple[TrainBatches, EvalBatches]:
        self.train_batches = TrainBatches()
        return self.train_batches, EvalBatches()

    def lr_at_step(self, step: int) -> float:
        return get_lr(step)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        _, loss = self.model(x, y)
        self.train_batches.fetch()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        _, loss = self.model(batch["x"], batch["y"])
        return {f"{batch['split']}/loss": loss}


def nanogpt_config(tmp_path: Path, **overrides: Any) -> DreamTrainerConfig:
    settings: dict[str, Any] = {
        "seed": 1337,
        "max_steps": MAX_ITERS + 1,  # iterations 0..MAX_ITERS
        "gradient_accumulation_steps": ACCUM,
        "gradient_clip_val": CLIP,
        "val_every_n_steps": EVAL_EVERY,
        "val_at_start": True,  # nanoGPT evaluates at iteration 0
        "val_restores_rng": False,  # its evaluation draws batches from the training RNG
    }
    return config(tmp_path, **{**settings, **overrides})


def test_nanogpt_style_gpt_port_ends_bit_identical(tmp_path: Path) -> None:
    expected, evals = nanogpt_loop()
    memory = MemoryLogger()
    trainer = NanoGPTPort(nanogpt_config(tmp_path, loggers=[memory]))
    trainer.fit()
    assert trainer.global_step == MAX_ITERS + 1
    assert weights_equal(trainer.model, expected)
    # Evaluations at iterations 0, 4, 8, 12 reach the logger at those steps, with the loop's values.
    for split in ("train", "val"):
        logged = memory.series(f"{split}/loss")
        assert [s for s, _ in logged] == sorted(evals)
        assert [v for _, v in logged] == pytest.approx([evals[s][split] for s in sorted(evals)], rel=1e-6)


def test_nanogpt_port_needs_validation_to_share_the_rng(tmp_path: Path) -> None:
    expected, _ = nanogpt_loop()
    trainer = NanoGPTPort(nanogpt_config(tmp_path, val_restores_rng=True))
    trainer.fit()
    assert not weights_equal(trainer.model, expected)  # the default keeps training apart from evaluation's draws


def generated_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The plainest loader: a generator drawing each batch when the loop asks for it."""
    while True:
        yield get_batch("train")


class GeneratorPort(NanoGPTPort):
    """The port with a generator loader: the trainer draws each batch when its step starts, after the
    validation due at that step."""

    def configure_dataloaders(self) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], EvalBatches]:
        return generated_batches(), EvalBatches()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return self.model(x, y)[1]


def test_a_generator_loader_ports_the_loop_that_draws_each_batch_before_its_forward(tmp_path: Path) -> None:
    # The same settings, another habit: a loop that draws a micro-batch right before its forward draws
    # it after the iteration's evaluation, as the trainer draws from a generator loader. That loop ports
    # exactly with a generator; nanoGPT's, which draws the next batch right after each forward (so before
    # the next iteration's evaluation), does not: the evaluation's draws and the batches' interleave
    # otherwise (the guide's table: fetch it in training_step, as NanoGPTPort does).
    trainer = GeneratorPort(nanogpt_config(tmp_path))
    trainer.fit()
    drawn_before_forward, _ = nanogpt_loop(fetch_ahead=False)
    nanogpt, _ = nanogpt_loop()
    assert trainer.global_step == MAX_ITERS + 1
    assert weights_equal(trainer.model, drawn_before_forward)
    assert not weights_equal(trainer.model, nanogpt)
