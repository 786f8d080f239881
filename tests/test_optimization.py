"""Optimization semantics (DESIGN.md "Optimization semantics"): accumulation, clipping, non-finite
gradient policies, several optimizers (GAN), automatic backward/step, schedulers and stop conditions.

Every trainer here is defined in this file (tiny linear models, SGD, unshuffled data) so the expected
weights can be computed by hand with plain PyTorch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_regression_data as regression_data
from helpers import plain_config as cfg
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import (
    Callback,
    DreamTrainer,
    DreamTrainerConfig,
    MemoryLogger,
    NonFiniteGradientError,
)

# --- helpers --------------------------------------------------------------------------------------


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return copy.deepcopy(nn.Linear(4, 1).state_dict())


def clone_params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def params_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def total_grad_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def manual_sgd(
    state: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float
) -> nn.Linear:
    """Reference: plain PyTorch, one SGD step per batch on the mean MSE."""
    model = nn.Linear(4, 1)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


class LinearTrainer(DreamTrainer):
    """Linear regression with SGD. `loader` is built from `x, y` with `batch_size` (or `batch_sampler`)."""

    def __init__(
        self,
        config: DreamTrainerConfig,
        state: dict[str, torch.Tensor] | None = None,
        n: int = 32,
        batch_size: int = 8,
        lr: float = 0.1,
        data: tuple[torch.Tensor, torch.Tensor] | None = None,
        batch_sampler: list[list[int]] | None = None,
    ) -> None:
        super().__init__(config)
        self.model = nn.Linear(4, 1)
        self.model.load_state_dict(state if state is not None else initial_state())
        self.lr = lr
        self.data = data if data is not None else regression_data(n)
        self.batch_size = batch_size
        self.batch_sampler = batch_sampler
        self.step_calls = 0
        self.batches_seen = 0

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        self.optimizer.register_step_post_hook(self._count_step)

    def _count_step(self, *args: Any) -> None:
        self.step_calls += 1

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        ds = TensorDataset(*self.data)
        if self.batch_sampler is not None:
            return DataLoader(ds, batch_sampler=self.batch_sampler), None
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False), None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.batches_seen += 1
        x, y = batch
        return {"loss": F.mse_loss(self.model(x), y)}


# --- gradient accumulation ------------------------------------------------------------------------


def test_accumulation_matches_large_batch(tmp_path: Any) -> None:
    state = initial_state()
    data = regression_data(64)
    acc = LinearTrainer(cfg(tmp_path, n_epochs=2, gradient_accumulation_steps=4), state, batch_size=8, data=data)
    acc.fit()
    big = LinearTrainer(cfg(tmp_path, n_epochs=2), state, batch_size=32, data=data)
    big.fit()
    # 2 epochs x 2 windows, optimizer stepped once per window
    assert acc.global_step == big.global_step == 4
    assert acc.step_calls == 4
    assert acc.batches_seen == 16
    for p_acc, p_big in zip(acc.model.parameters(), big.model.parameters(), strict=True):
        assert torch.allclose(p_acc, p_big, atol=1e-6, rtol=0)
    # and the weights really moved
    assert not torch.allclose(acc.model.weight, state["weight"])


def test_accumulation_short_last_window_averages_over_its_real_size(tmp_path: Any) -> None:
    state = initial_state()
    data = regression_data(40)
    # 5 batches of 8, accumulation 4 -> windows of 4 and 1 batches per epoch
    acc = LinearTrainer(cfg(tmp_path, n_epochs=2, gradient_accumulation_steps=4), state, batch_size=8, data=data)
    acc.fit()
    assert acc.global_step == 4  # 2 windows per epoch
    assert acc.step_calls == 4
    # reference: a batch of 32 then a batch of 8, no accumulation
    ref = LinearTrainer(
        cfg(tmp_path, n_epochs=2), state, data=data, batch_sampler=[list(range(32)), list(range(32, 40))]
    )
    ref.fit()
    assert ref.global_step == 4
    for p_acc, p_ref in zip(acc.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.allclose(p_acc, p_ref, atol=1e-6, rtol=0)
    x, y = data
    manual = manual_sgd(state, [(x[:32], y[:32]), (x[32:], y[32:])] * 2, lr=0.1)
    for p_acc, p_man in zip(acc.model.parameters(), manual.parameters(), strict=True):
        assert torch.allclose(p_acc, p_man, atol=1e-6, rtol=0)


def test_accumulation_explicit_backward_and_step(tmp_path: Any) -> None:
    """Same equivalence when training_step calls self.backward and self.step itself."""

    class Explicit(LinearTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.step(self.optimizer)
            return {"loss": loss}

    state = initial_state()
    data = regression_data(64)
    acc = Explicit(cfg(tmp_path, n_epochs=1, gradient_accumulation_steps=4), state, batch_size=8, data=data)
    acc.fit()
    x, y = data
    manual = manual_sgd(state, [(x[:32], y[:32]), (x[32:], y[32:])], lr=0.1)
    assert acc.global_step == 2
    assert acc.step_calls == 2
    for p_acc, p_man in zip(acc.model.parameters(), manual.parameters(), strict=True):
        assert torch.allclose(p_acc, p_man, atol=1e-6, rtol=0)


def test_accumulation_with_loader_without_length_closes_last_window(tmp_path: Any) -> None:
    """A loader without `len()`: the short last window is still stepped at the end of the epoch."""

    class NoLen:
        def __init__(self, loader: DataLoader) -> None:
            self.loader = loader

        def __iter__(self) -> Any:
            return iter(self.loader)

    class Unsized(LinearTrainer):
        def configure_dataloaders(self) -> tuple[Any, None]:
            train, _ = super().configure_dataloaders()
            return NoLen(train), None

    t = Unsized(cfg(tmp_path, n_epochs=2, gradient_accumulation_steps=4), n=40)  # 5 batches of 8
    w0 = clone_params(t.model)
    t.fit()
    assert t.batches_seen == 10
    assert t.global_step == 4
    assert t.step_calls == 4
    assert not params_equal(w0, clone_params(t.model))


# --- gradient clipping ----------------------------------------------------------------------------


class GradNormRecorder(Callback):
    """Total grad norm right after backward (unclipped) and right before the optimizer step (clipped)."""

    def __init__(self) -> None:
        self.after_backward: list[float] = []
        self.before_step: list[float] = []
        self.max_abs_before_step: list[float] = []
        self.max_abs_after_backward: list[float] = []

    def on_after_backward(self, trainer: DreamTrainer) -> None:
        opt = trainer.optimizer  # type: ignore[attr-defined]
        self.after_backward.append(total_grad_norm(opt))
        self.max_abs_after_backward.append(max(float(p.grad.abs().max()) for p in trainer.model.parameters()))  # type: ignore[attr-defined]

    def on_before_optimizer_step(self, trainer: DreamTrainer, optimizer: torch.optim.Optimizer) -> None:
        self.before_step.append(total_grad_norm(optimizer))
        self.max_abs_before_step.append(
            max(float(p.grad.abs().max()) for g in optimizer.param_groups for p in g["params"])
        )


def test_clip_by_norm_from_config(tmp_path: Any) -> None:
    rec = GradNormRecorder()
    t = LinearTrainer(
        cfg(tmp_path, n_epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm="norm", callbacks=[rec]),
        data=regression_data(32, scale=10.0),
    )
    t.fit()
    assert len(rec.before_step) == 4
    assert all(n > 0.5 for n in rec.after_backward)  # clipping had something to do
    assert all(n <= 0.5 + 1e-5 for n in rec.before_step)
    # clipping by norm rescales, it does not zero: the norm is exactly max_norm
    assert all(n == pytest.approx(0.5, rel=1e-4) for n in rec.before_step)


def test_clip_by_value_from_config(tmp_path: Any) -> None:
    rec = GradNormRecorder()
    t = LinearTrainer(
        cfg(tmp_path, n_epochs=1, gradient_clip_val=0.05, gradient_clip_algorithm="value", callbacks=[rec]),
        data=regression_data(32, scale=10.0),
    )
    t.fit()
    assert len(rec.before_step) == 4
    assert all(m > 0.05 for m in rec.max_abs_after_backward)
    assert all(m <= 0.05 + 1e-7 for m in rec.max_abs_before_step)


def test_clip_gradients_inside_training_step_clips_that_step(tmp_path: Any) -> None:
    """Seed 004: `self.clip_gradients(self.optimizer, max_norm=...)` after backward, no explicit step."""

    class ClipInStep(LinearTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            if batch_idx % 2 == 0:
                self.clip_gradients(self.optimizer, max_norm=0.25)
            return {"loss": loss}

    rec = GradNormRecorder()
    t = ClipInStep(cfg(tmp_path, n_epochs=1, callbacks=[rec]), data=regression_data(32, scale=10.0))
    t.fit()
    assert t.step_calls == 4
    assert all(n > 0.25 for n in rec.after_backward)
    # batches 0 and 2 clipped, 1 and 3 not (the request applies to one step only)
    assert rec.before_step[0] <= 0.25 + 1e-5
    assert rec.before_step[2] <= 0.25 + 1e-5
    assert rec.before_step[1] == pytest.approx(rec.after_backward[1], rel=1e-6)
    assert rec.before_step[3] == pytest.approx(rec.after_backward[3], rel=1e-6)


def test_step_returns_grad_norm_when_clipping_by_norm(tmp_path: Any) -> None:
    class ReturnsNorm(LinearTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.norms: list[Any] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.norms.append(self.step(self.optimizer))
            return {"loss": loss}

    rec = GradNormRecorder()
    t = ReturnsNorm(
        cfg(tmp_path, n_epochs=1, gradient_clip_val=0.5, callbacks=[rec]), data=regression_data(32, scale=10.0)
    )
    t.fit()
    assert len(t.norms) == 4
    for norm, unclipped in zip(t.norms, rec.after_backward, strict=True):
        assert isinstance(norm, torch.Tensor)
        # the norm before clipping (what torch.nn.utils.clip_grad_norm_ returns)
        assert float(norm) == pytest.approx(unclipped, rel=1e-5)
    assert t.step_calls == 4  # no second, automatic step


# --- non-finite gradients -------------------------------------------------------------------------


class NaNTrainer(LinearTrainer):
    """Loss times NaN on the batches in `bad_batches`; `nan_attempts` limits it to the first k attempts
    of such a batch (None: every attempt). The optimizer is named `my_sgd`."""

    def __init__(
        self,
        config: DreamTrainerConfig,
        bad_batches: tuple[int, ...] = (1,),
        nan_attempts: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self.bad_batches = bad_batches
        self.nan_attempts = nan_attempts
        self.attempts: dict[tuple[int, int], int] = {}
        self.weights_before: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.weights_after: dict[tuple[int, int], list[torch.Tensor]] = {}

    def configure_optimizers(self) -> None:
        self.my_sgd = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        self.my_sgd.register_step_post_hook(self._count_step)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.weights_before[(self.current_epoch, batch_idx)] = clone_params(self.model)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.weights_after[(self.current_epoch, batch_idx)] = clone_params(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        key = (self.current_epoch, batch_idx)
        self.attempts[key] = self.attempts.get(key, 0) + 1
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        if batch_idx in self.bad_batches and (self.nan_attempts is None or self.attempts[key] <= self.nan_attempts):
            loss = loss * float("nan")
        return {"loss": loss}


def test_non_finite_raise_names_optimizer_and_setting(tmp_path: Any) -> None:
    t = NaNTrainer(cfg(tmp_path, n_epochs=1, non_finite_grads="raise"))
    with pytest.raises(NonFiniteGradientError) as info:
        t.fit()
    msg = str(info.value)
    assert "my_sgd" in msg
    assert "non_finite_grads" in msg
    assert t.step_calls == 1  # batch 0 stepped, batch 1 raised before its step


def test_non_finite_skip_keeps_weights_and_counts(tmp_path: Any) -> None:
    logger = MemoryLogger()
    t = NaNTrainer(cfg(tmp_path, n_epochs=1, non_finite_grads="skip", log_every_n_steps=1, loggers=[logger]))
    t.fit()
    assert t.non_finite_counts["skipped"] == 1
    assert t.non_finite_counts["retried"] == 0
    # the bad step left the weights alone, the good ones moved them
    assert params_equal(t.weights_before[(0, 1)], t.weights_after[(0, 1)])
    assert not params_equal(t.weights_before[(0, 2)], t.weights_after[(0, 2)])
    assert t.step_calls == 3
    assert t.global_step == 4  # a skipped step is still a training step
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    skipped = logger.series("non_finite/skipped")
    assert skipped, "non_finite/skipped was never logged"
    assert skipped[-1][1] == 1.0


def test_non_finite_retry_recovers_and_matches_clean_run(tmp_path: Any) -> None:
    logger = MemoryLogger()
    t = NaNTrainer(
        cfg(tmp_path, n_epochs=1, non_finite_grads="retry", log_every_n_steps=1, loggers=[logger]), nan_attempts=1
    )
    t.fit()
    assert t.non_finite_counts["retried"] == 1
    assert t.non_finite_counts["skipped"] == 0
    assert t.attempts[(0, 1)] == 2
    assert t.attempts[(0, 0)] == 1
    assert t.global_step == 4
    assert t.step_calls == 4
    # the retried batch was trained on: the result equals a run that never saw a NaN
    clean = LinearTrainer(cfg(tmp_path, n_epochs=1))
    clean.fit()
    for p, q in zip(t.model.parameters(), clean.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7, rtol=0)
    retried = logger.series("non_finite/retried")
    assert retried and retried[-1][1] == 1.0


def test_non_finite_retry_gives_up_after_max_retries(tmp_path: Any) -> None:
    t = NaNTrainer(cfg(tmp_path, n_epochs=1, non_finite_grads="retry", max_non_finite_retries=2))
    with pytest.raises(NonFiniteGradientError) as info:
        t.fit()
    assert "max_non_finite_retries" in str(info.value)
    assert "my_sgd" in str(info.value)
    assert t.attempts[(0, 1)] == 3  # the first attempt plus 2 retries
    assert (0, 2) not in t.attempts


def test_non_finite_ignore_lets_nan_into_weights(tmp_path: Any) -> None:
    # With both checks off (non_finite_loss="raise", the default, would stop the run at the epoch's end).
    t = NaNTrainer(cfg(tmp_path, n_epochs=1, non_finite_grads="ignore", non_finite_loss="ignore"))
    t.fit()
    assert t.step_calls == 4
    assert t.non_finite_counts == {"skipped": 0, "retried": 0}
    assert torch.isnan(t.model.weight).all()


def test_non_finite_skip_with_accumulation_skips_the_whole_window(tmp_path: Any) -> None:
    t = NaNTrainer(cfg(tmp_path, n_epochs=1, non_finite_grads="skip", gradient_accumulation_steps=2))
    t.fit()
    assert t.global_step == 2
    assert t.non_finite_counts["skipped"] == 1
    assert t.step_calls == 1
    # window 1 (batches 0 and 1, NaN in batch 1) left the weights alone; window 2 moved them
    assert params_equal(t.weights_before[(0, 0)], t.weights_after[(0, 1)])
    assert not params_equal(t.weights_before[(0, 2)], t.weights_after[(0, 3)])
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


# --- several optimizers (GAN) ---------------------------------------------------------------------


class GANTrainer(DreamTrainer):
    def __init__(self, config: DreamTrainerConfig, n: int = 24, batch_size: int = 4) -> None:
        super().__init__(config)
        torch.manual_seed(0)
        self.generator = nn.Linear(2, 2)
        self.discriminator = nn.Linear(2, 1)
        g = torch.Generator().manual_seed(1)
        self.real = torch.randn(n, 2, generator=g) + 3.0
        self.noise = torch.randn(n, 2, generator=g)
        self.batch_size = batch_size
        self.d_grad_reference: list[list[torch.Tensor]] = []
        self.d_grad_at_step: list[list[torch.Tensor]] = []
        self.g_grad_reference: list[list[torch.Tensor]] = []
        self.g_grad_at_step: list[list[torch.Tensor]] = []
        self.opt_calls: list[str] = []

    def configure_optimizers(self) -> None:
        self.g_optimizer = torch.optim.SGD(self.generator.parameters(), lr=0.05)
        self.d_optimizer = torch.optim.SGD(self.discriminator.parameters(), lr=0.05)

    def configure_dataloaders(self) -> tuple[DataLoader, None]:
        return DataLoader(TensorDataset(self.real, self.noise), batch_size=self.batch_size), None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self.d_optimizer:
            self.opt_calls.append("d")
            self.d_grad_at_step.append([p.grad.clone() for p in self.discriminator.parameters()])
        else:
            self.opt_calls.append("g")
            self.g_grad_at_step.append([p.grad.clone() for p in self.generator.parameters()])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        real, z = batch
        fake = self.generator(z)
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        self.d_grad_reference.append(
            [g.clone() for g in torch.autograd.grad(d_loss, list(self.discriminator.parameters()), retain_graph=True)]
        )
        self.backward(d_loss)
        self.step(self.d_optimizer)

        g_loss = F.softplus(-self.discriminator(fake)).mean()
        self.g_grad_reference.append(
            [g.clone() for g in torch.autograd.grad(g_loss, list(self.generator.parameters()), retain_graph=True)]
        )
        self.backward(g_loss)
        self.step(self.g_optimizer)
        return {"d_loss": d_loss, "g_loss": g_loss}


def test_gan_two_optimizers_one_global_step_per_batch_and_no_grad_leak(tmp_path: Any) -> None:
    t = GANTrainer(cfg(tmp_path, n_epochs=2))
    g0, d0 = clone_params(t.generator), clone_params(t.discriminator)
    t.fit()
    n_batches = 2 * 6
    assert t.global_step == n_batches  # not 2 * n_batches
    assert t.opt_calls == ["d", "g"] * n_batches  # each stepped once per batch, no automatic extra step
    assert not params_equal(g0, clone_params(t.generator))
    assert not params_equal(d0, clone_params(t.discriminator))
    # D's step sees exactly the gradient of d_loss: g_loss's gradient through D (after D's step on the
    # previous batch) must have been zeroed at the start of the next step.
    for step, (ref, seen) in enumerate(zip(t.d_grad_reference, t.d_grad_at_step, strict=True)):
        for r, s in zip(ref, seen, strict=True):
            assert torch.allclose(r, s, atol=1e-7), f"D gradient leaked into step {step}"
    for ref, seen in zip(t.g_grad_reference, t.g_grad_at_step, strict=True):
        for r, s in zip(ref, seen, strict=True):
            assert torch.allclose(r, s, atol=1e-7)


def test_gradients_zeroed_at_window_start_with_on_before_zero_grad_first(tmp_path: Any) -> None:
    class ZeroGradRecorder(Callback):
        def __init__(self) -> None:
            self.events: list[tuple[str, bool]] = []

        def on_before_zero_grad(self, trainer: DreamTrainer, optimizer: torch.optim.Optimizer) -> None:
            name = "d" if optimizer is trainer.d_optimizer else "g"  # type: ignore[attr-defined]
            has_grad = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
            self.events.append((name, has_grad))

    rec = ZeroGradRecorder()
    t = GANTrainer(cfg(tmp_path, n_epochs=1, callbacks=[rec]))
    t.fit()
    # once per optimizer per step; from the second step on there were gradients to clear
    assert len(rec.events) == 2 * 6
    assert sorted(name for name, _ in rec.events[:2]) == ["d", "g"]
    assert all(has for _, has in rec.events[2:])


# --- automatic backward / step --------------------------------------------------------------------


@pytest.mark.parametrize("style", ["tensor", "dict"])
def test_returned_loss_is_backpropagated_and_stepped(tmp_path: Any, style: str) -> None:
    class Returns(LinearTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            return loss if style == "tensor" else {"loss": loss}

    state = initial_state()
    data = regression_data(32)
    t = Returns(cfg(tmp_path, n_epochs=1), state, data=data)
    t.fit()
    assert t.step_calls == 4
    assert t.global_step == 4
    x, y = data
    manual = manual_sgd(state, [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)], lr=0.1)
    for p, q in zip(t.model.parameters(), manual.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)


def test_backward_without_step_steps_every_optimizer(tmp_path: Any) -> None:
    class TwoModels(LinearTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.head = nn.Linear(1, 1)
            self.head_steps = 0

        def configure_optimizers(self) -> None:
            super().configure_optimizers()
            self.head_optimizer = torch.optim.SGD(self.head.parameters(), lr=0.1)
            self.head_optimizer.register_step_post_hook(self._count_head)

        def _count_head(self, *args: Any) -> None:
            self.head_steps += 1

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.head(self.model(x)), y)
            self.backward(loss)
            return {"loss": loss}  # a "loss" entry, but backward already ran: no second backward

    t = TwoModels(cfg(tmp_path, n_epochs=1))
    head0 = clone_params(t.head)
    t.fit()
    assert t.step_calls == 4
    assert t.head_steps == 4
    assert not params_equal(head0, clone_params(t.head))


def test_backward_counts_once_when_loss_also_returned(tmp_path: Any) -> None:
    """self.backward(loss) + return {"loss": loss}: the trainer must not backpropagate a second time
    (the gradient would double and the graph is already freed)."""

    class BackwardAndReturn(LinearTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            return {"loss": loss}

    state = initial_state()
    data = regression_data(32)
    t = BackwardAndReturn(cfg(tmp_path, n_epochs=1), state, data=data)
    t.fit()
    x, y = data
    manual = manual_sgd(state, [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)], lr=0.1)
    for p, q in zip(t.model.parameters(), manual.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)


def test_explicit_backward_and_step_do_not_double_step(tmp_path: Any) -> None:
    class Explicit(LinearTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.step(self.optimizer)
            return {"loss": loss}

    state = initial_state()
    data = regression_data(32)
    t = Explicit(cfg(tmp_path, n_epochs=2), state, data=data)
    t.fit()
    assert t.step_calls == 8
    assert t.global_step == 8
    x, y = data
    manual = manual_sgd(state, [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)] * 2, lr=0.1)
    for p, q in zip(t.model.parameters(), manual.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)


def test_explicit_step_is_noop_inside_accumulation_window(tmp_path: Any) -> None:
    class Explicit(LinearTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.returned: list[Any] = []
            self.steps_after_call: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.returned.append(self.step(self.optimizer))
            self.steps_after_call.append(self.step_calls)
            return {"loss": loss}

    # clipping makes step() compute (and return) the norm when it really steps
    t = Explicit(cfg(tmp_path, n_epochs=1, gradient_accumulation_steps=2, gradient_clip_val=1e6))
    t.fit()
    assert t.returned[0] is None and t.returned[2] is None
    assert isinstance(t.returned[1], torch.Tensor) and isinstance(t.returned[3], torch.Tensor)
    assert t.steps_after_call == [0, 1, 1, 2]
    assert t.global_step == 2


# --- schedulers -----------------------------------------------------------------------------------


class SchedTrainer(LinearTrainer):
    def __init__(self, config: DreamTrainerConfig, gamma: float = 0.5, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.gamma = gamma
        self.lrs_seen: list[float] = []

    def configure_optimizers(self) -> None:
        super().configure_optimizers()
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=self.gamma)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs_seen.append(self.optimizer.param_groups[0]["lr"])


def test_scheduler_steps_once_per_epoch_by_default(tmp_path: Any) -> None:
    t = SchedTrainer(cfg(tmp_path, n_epochs=3), gamma=0.5)
    t.fit()
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert t.lrs_seen == pytest.approx([0.1] * 4 + [0.05] * 4 + [0.025] * 4)


def test_scheduler_interval_step_steps_after_each_optimizer_step(tmp_path: Any) -> None:
    t = SchedTrainer(cfg(tmp_path, n_epochs=3, scheduler_interval="step"), gamma=0.9)
    t.fit()
    assert t.step_calls == 12
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**12)
    assert t.lrs_seen == pytest.approx([0.1 * 0.9**k for k in range(12)])


def test_scheduler_interval_step_with_accumulation_steps_per_window(tmp_path: Any) -> None:
    t = SchedTrainer(cfg(tmp_path, n_epochs=1, scheduler_interval="step", gradient_accumulation_steps=2), gamma=0.9)
    t.fit()
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**2)


def test_reduce_lr_on_plateau_gets_monitored_metric(tmp_path: Any) -> None:
    class RecordingPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seen: list[float] = []

        def step(self, metrics: Any, epoch: Any = None) -> None:  # type: ignore[override]
            self.seen.append(float(metrics))
            super().step(metrics)

    class PlateauTrainer(LinearTrainer):
        def configure_optimizers(self) -> None:
            super().configure_optimizers()
            self.scheduler = RecordingPlateau(self.optimizer, mode="min", factor=0.5, patience=0)

        def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
            train, _ = super().configure_dataloaders()
            return train, DataLoader(TensorDataset(*regression_data(8, seed=1)), batch_size=4)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            # a made-up metric that never improves after the first epoch
            return {"my_metric": torch.tensor(5.0 + self.current_epoch)}

    t = PlateauTrainer(cfg(tmp_path, n_epochs=3, scheduler_monitor="my_metric"))
    t.fit()
    assert t.scheduler.seen == [5.0, 6.0, 7.0]
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


def test_reduce_lr_on_plateau_without_monitored_metric_names_the_setting(tmp_path: Any) -> None:
    class PlateauNoVal(LinearTrainer):
        def configure_optimizers(self) -> None:
            super().configure_optimizers()
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer)

    with pytest.raises(KeyError, match="scheduler_monitor"):
        PlateauNoVal(cfg(tmp_path, n_epochs=1)).fit()


# --- stop conditions and batch limits -------------------------------------------------------------


def test_max_steps_stops_mid_epoch(tmp_path: Any) -> None:
    t = LinearTrainer(cfg(tmp_path, n_epochs=5, max_steps=3), n=80)  # 10 batches per epoch
    t.fit()
    assert t.global_step == 3
    assert t.batches_seen == 3
    assert t.step_calls == 3


def test_max_steps_counts_windows_with_accumulation(tmp_path: Any) -> None:
    t = LinearTrainer(cfg(tmp_path, n_epochs=5, max_steps=3, gradient_accumulation_steps=2), n=80)
    t.fit()
    assert t.global_step == 3
    assert t.batches_seen == 6
    assert t.step_calls == 3


def test_n_epochs_none_with_max_steps(tmp_path: Any) -> None:
    class CountEpochs(LinearTrainer):
        epochs_started = 0

        def on_train_epoch_start(self) -> None:
            self.epochs_started += 1

    t = CountEpochs(cfg(tmp_path, n_epochs=None, max_steps=25), n=80)  # 10 batches per epoch
    t.fit()
    assert t.global_step == 25
    assert t.batches_seen == 25
    assert t.epochs_started == 3


@pytest.mark.parametrize(("limit", "expected"), [(3, 3), (0.5, 5), (1.0, 10), (0.01, 1)])
def test_limit_train_batches(tmp_path: Any, limit: float, expected: int) -> None:
    t = LinearTrainer(cfg(tmp_path, n_epochs=2, limit_train_batches=limit), n=80)  # 10 batches per epoch
    t.fit()
    assert t.batches_seen == 2 * expected
    assert t.global_step == 2 * expected
