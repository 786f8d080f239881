"""What a Lightning user's code does on first contact (issue 15, "Coming from Lightning").

One test per habit; each failed (or trained differently, silently) before the trainer handled it:

1. a GAN stepping the generator first: its loss must not leak into the discriminator's step
   (`self.backward(loss, optimizer=...)`, `toggle_optimizer`);
2. `configure_optimizers` returning optimizers/schedulers in Lightning's forms; `optimizers()`,
   `lr_schedulers()`;
3. `training_step(self, batch)` (and the other steps) without `batch_idx`;
4. `self(x)` running the trainer's `forward`;
5. a callback with Lightning's `(trainer, pl_module, ...)` hooks: refused when attached;
6. a step that calls `loss.backward()` / `optimizer.step()` itself: one warning naming what is bypassed;
7. `max_steps` with several optimizers: one warning that it counts batches, not optimizer steps.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTrainer, make_regression_data, quiet_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import Callback, DreamTrainer
from dream_trainer.errors import CallbackHookError, MisconfigurationError
from dream_trainer.lightning import step_checks as step_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # bitwise comparisons: the same kernels


def weights(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --- 1. a GAN in either order -----------------------------------------------------------------------------
GAN_REAL = torch.randn(64, 2, generator=torch.Generator().manual_seed(1)) + 3.0
GAN_Z = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))


def gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    d = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    return g, d


def g_loss_of(g: nn.Module, d: nn.Module, z: torch.Tensor) -> torch.Tensor:
    return F.softplus(-d(g(z))).mean()


def d_loss_of(g: nn.Module, d: nn.Module, real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return (F.softplus(-d(real)) + F.softplus(d(g(z).detach()))).mean()


def reference_gan(order: str) -> list[torch.Tensor]:
    """Plain PyTorch, Lightning's `toggle_optimizer` by hand: the other model frozen around each loss."""
    g, d = gan_models()
    g_opt, d_opt = torch.optim.Adam(g.parameters(), lr=1e-2), torch.optim.Adam(d.parameters(), lr=1e-2)
    for real, z in zip(GAN_REAL.split(16), GAN_Z.split(16), strict=True):
        g_opt.zero_grad(set_to_none=True)
        d_opt.zero_grad(set_to_none=True)
        for part in order:
            if part == "g":
                d.requires_grad_(False)
                g_loss_of(g, d, z).backward()
                d.requires_grad_(True)
                g_opt.step()
            else:
                g.requires_grad_(False)
                d_loss_of(g, d, real, z).backward()
                g.requires_grad_(True)
                d_opt.step()
    return weights(g, d)


class GAN(DreamTrainer):
    def __init__(self, config: Any, order: str, scope: str) -> None:
        super().__init__(config)
        self.order, self.scope = order, scope

    def configure_models(self) -> None:
        self.generator, self.discriminator = gan_models()

    def configure_optimizers(self) -> None:
        self.g_optimizer = torch.optim.Adam(self.generator.parameters(), lr=1e-2)
        self.d_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=1e-2)

    def configure_dataloaders(self) -> Any:
        return DataLoader(TensorDataset(GAN_REAL, GAN_Z), batch_size=16), None

    def _backward(self, loss_fn: Any, optimizer: torch.optim.Optimizer) -> None:
        if self.scope == "optimizer=":
            self.backward(loss_fn(), optimizer=optimizer)
        elif self.scope == "toggle":
            with self.toggle_optimizer(optimizer):
                self.backward(loss_fn())
        else:  # unscoped: a loss's gradients reach every model it flows through
            self.backward(loss_fn())
        self.step(optimizer)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        g, d = self.generator, self.discriminator
        for part in self.order:
            if part == "g":
                self._backward(lambda: g_loss_of(g, d, z), self.g_optimizer)
            else:
                self._backward(lambda: d_loss_of(g, d, real, z), self.d_optimizer)


def trained_gan(tmp_path: Any, order: str, scope: str) -> list[torch.Tensor]:
    t = GAN(quiet_config(tmp_path / f"{order}-{scope}", n_epochs=1, seed=None), order, scope)
    t.fit()
    assert t.global_step == 4
    assert all(p.requires_grad for p in (*t.generator.parameters(), *t.discriminator.parameters()))
    return weights(t.generator, t.discriminator)


@pytest.mark.parametrize("order", ["gd", "dg"], ids=["generator-first", "discriminator-first"])
@pytest.mark.parametrize("scope", ["optimizer=", "toggle"])
def test_1_gan_losses_stay_with_their_optimizer_in_any_order(tmp_path, order, scope):
    assert all_equal(trained_gan(tmp_path, order, scope), reference_gan(order))


def routing_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "also put gradients on" in str(w.message)]


def test_1_an_unscoped_generator_first_gan_leaks_which_is_why_scoping_exists(tmp_path):
    # Discriminator first, unscoped: the generator loss's gradients on D are zeroed before D's next step.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert all_equal(trained_gan(tmp_path, "dg", "none"), reference_gan("dg"))
    assert routing_warnings(record) == []  # nothing leaks: nothing said
    # Generator first, unscoped: D's step adds them (what Lightning's toggle_optimizer prevents), and
    # the first step says so, once, naming both optimizers and the fix.
    with pytest.warns(UserWarning) as record:
        assert not all_equal(trained_gan(tmp_path, "gd", "none"), reference_gan("gd"))
    said = routing_warnings(record)
    assert len(said) == 1
    assert (
        "self.backward(loss) before self.step(g_optimizer) also put gradients on the parameters of d_optimizer, "
        "which steps later in the batch with them" in said[0]
    )
    assert "self.backward(loss, optimizer=self.g_optimizer)" in said[0]


@pytest.mark.parametrize("scope", ["optimizer=", "toggle"])
def test_1_scoped_losses_are_not_warned_about(tmp_path, scope):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trained_gan(tmp_path, "gd", scope)
    assert routing_warnings(record) == []


def test_1_a_leak_across_an_accumulation_window_is_named(tmp_path):
    # Discriminator first, unscoped, windows of 2 batches: the generator loss of batch 1 stays on D's
    # gradients until D steps at the end of the window.
    t = GAN(quiet_config(tmp_path, n_epochs=1, gradient_accumulation_steps=2), "dg", "none")
    with pytest.warns(UserWarning) as record:
        t.fit()
    said = routing_warnings(record)
    assert len(said) == 1 and "which steps at the end of the accumulation window" in said[0]


class OneLossTwoOptimizers(TinyTrainer):
    """An encoder and a head with their own optimizers, one loss for both: not a leak."""

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))

    def configure_optimizers(self) -> None:
        self.encoder_optimizer = torch.optim.SGD(self.model[0].parameters(), lr=0.1)
        self.head_optimizer = torch.optim.Adam(self.model[1].parameters(), lr=0.01)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.backward(F.mse_loss(self.model(x), y))
        self.step(self.encoder_optimizer)
        self.step(self.head_optimizer)


def test_1_one_loss_for_two_optimizers_is_not_a_leak(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        OneLossTwoOptimizers(quiet_config(tmp_path)).fit()
    assert routing_warnings(record) == []


def test_1_toggle_optimizer_restores_requires_grad_also_without_with(tmp_path):
    t = GAN(quiet_config(tmp_path, n_epochs=1), "gd", "toggle")
    t._setup_fit()
    frozen = next(t.generator.parameters())
    frozen.requires_grad_(False)  # frozen by the user: stays frozen
    t.toggle_optimizer(t.d_optimizer)  # Lightning's call style
    assert not any(p.requires_grad for p in t.generator.parameters())
    assert all(p.requires_grad for p in t.discriminator.parameters())
    t.untoggle_optimizer(t.d_optimizer)
    assert not frozen.requires_grad
    assert all(p.requires_grad for p in list(t.generator.parameters())[1:])


# --- 2. configure_optimizers returns ---------------------------------------------------------------------
class Returns(TinyTrainer):
    def __init__(self, config: Any, form: str) -> None:
        super().__init__(config, n_val=0)
        self.head = nn.Linear(4, 1)
        self.form = form

    def configure_optimizers(self) -> Any:
        o1 = torch.optim.SGD(self.model.parameters(), lr=0.1)
        o2 = torch.optim.SGD(self.head.parameters(), lr=0.1)
        s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=1, gamma=0.5)
        s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.5)
        step_dict = {"scheduler": s1, "interval": "step", "frequency": 1, "monitor": "val_loss"}
        return {
            "single": o1,
            "list": [o1, o2],
            "tuple": (o1, o2),
            "two lists": ([o1, o2], [s1, s2]),
            "dict": {"optimizer": o1, "lr_scheduler": s1},
            "dict, scheduler dict": {"optimizer": o1, "lr_scheduler": step_dict},
            "list of dicts": [{"optimizer": o1, "lr_scheduler": step_dict}, {"optimizer": o2}],
            # unsupported
            "a scheduler alone": s1,
            "a string": "adam",
            "dict without optimizer": {"lr_scheduler": s1},
            "frequency 2": {"optimizer": o1, "lr_scheduler": {"scheduler": s1, "frequency": 2}},
        }[self.form]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x) + self.head(x), y)


@pytest.mark.parametrize(
    ("form", "n_opts", "n_scheds", "lr_after"),
    [
        ("single", 1, 0, 0.1),
        ("list", 2, 0, 0.1),
        ("tuple", 2, 0, 0.1),
        ("two lists", 2, 2, 0.05),  # per epoch (config.scheduler_interval): one step
        ("dict", 1, 1, 0.05),
        ("dict, scheduler dict", 1, 1, 0.1 * 0.5**4),  # "interval": "step": once per step, 4 steps
        ("list of dicts", 2, 1, 0.1 * 0.5**4),
    ],
)
def test_2_configure_optimizers_may_return_lightning_forms(tmp_path, form, n_opts, n_scheds, lr_after):
    t = Returns(quiet_config(tmp_path, n_epochs=1), form)
    before = weights(t.model)
    t.fit()
    assert not all_equal(weights(t.model), before)
    opts = t.optimizers()
    opts = opts if isinstance(opts, list) else [opts]
    assert len(opts) == n_opts
    assert [n for n, _ in t.named_optimizers()] == ["optimizer", "optimizer_1"][:n_opts]
    assert opts[0] is t.optimizer and opts[0].param_groups[0]["params"][0] is t.model.weight
    assert opts[0].param_groups[0]["lr"] == pytest.approx(lr_after)
    scheds = t.lr_schedulers()
    assert len(scheds if isinstance(scheds, list) else [] if scheds is None else [scheds]) == n_scheds
    assert "lr_scheduler" in t.state_dict()["schedulers"] or n_scheds == 0  # saved in checkpoints


def test_2_a_returned_step_scheduler_trains_as_an_assigned_one(tmp_path):
    class Assigned(Returns):
        def configure_optimizers(self) -> None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)

    class Returned(Returns):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    a = Assigned(quiet_config(tmp_path / "a", n_epochs=2, scheduler_interval="step"), "")
    r = Returned(quiet_config(tmp_path / "r", n_epochs=2), "")
    a.fit()
    r.fit()
    assert all_equal(weights(a.model), weights(r.model))


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ("a scheduler alone", "returned StepLR"),
        ("a string", "returned str"),
        ("dict without optimizer", "a dict with keys ['lr_scheduler']"),
        ("frequency 2", "frequency=2 is not supported"),
    ],
)
def test_2_unsupported_return_forms_fail_at_setup_saying_what_to_write(tmp_path, form, message):
    t = Returns(quiet_config(tmp_path, n_epochs=1), form)
    with pytest.raises(MisconfigurationError) as err:
        t.fit()
    assert message in str(err.value)
    assert t.global_step == 0
    if form != "frequency 2":
        assert 'return an optimizer; a list of optimizers; `[optimizers], [schedulers]`; `{"optimizer": opt' in str(
            err.value
        )
        assert "Or return nothing and assign them: `self.optimizer = torch.optim.AdamW(...)`" in str(err.value)


# --- 3. steps without batch_idx -------------------------------------------------------------------------
class NoBatchIdx(TinyTrainer):
    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch):
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def test_step(self, batch):
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}

    def predict_step(self, batch):
        return self.model(batch[0])


def test_3_steps_without_batch_idx_run_and_are_inspected_once(tmp_path, monkeypatch):
    calls = []
    arity = step_module._positional_arity
    monkeypatch.setattr(step_module, "_positional_arity", lambda fn: calls.append(fn) or arity(fn))
    t = NoBatchIdx(quiet_config(tmp_path, n_epochs=3, num_sanity_val_steps=1))
    ref = TinyTrainer(quiet_config(tmp_path / "ref", n_epochs=3))
    t.fit()
    ref.fit()
    assert all_equal(weights(t.model), weights(ref.model))
    assert t.callback_metrics["val_loss"] == ref.callback_metrics["val_loss"]
    x, y = make_regression_data(24)
    loader = DataLoader(TensorDataset(x[16:], y[16:]), batch_size=4)
    assert "test_loss" in t.test(loader)
    assert len(t.predict(loader)) == 2
    # Once per step method, at setup: not per training step (12) or validation batch.
    assert len([fn for fn in calls if fn.__self__ is t]) == 4


def test_3_a_training_step_with_lightning_1x_optimizer_idx_fails_at_setup(tmp_path):
    class Old(TinyTrainer):
        def training_step(self, batch, batch_idx, optimizer_idx):
            raise AssertionError("never called")

    with pytest.raises(MisconfigurationError, match="optimizer_idx is gone"):
        Old(quiet_config(tmp_path)).fit()


# --- 4. self(x) --------------------------------------------------------------------------------------
def test_4_self_call_runs_forward(tmp_path):
    class WithForward(TinyTrainer):
        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

    t = WithForward(quiet_config(tmp_path, n_epochs=2))
    ref = TinyTrainer(quiet_config(tmp_path / "ref", n_epochs=2))
    t.fit()
    ref.fit()
    assert all_equal(weights(t.model), weights(ref.model))

    class NoForward(TinyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

    with pytest.raises(MisconfigurationError, match=r"define forward\(self, x\) on your trainer, or call self.model"):
        NoForward(quiet_config(tmp_path / "no")).fit()


# --- 5. Lightning-style callback hooks ----------------------------------------------------------------------
class LightningStyle(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        raise AssertionError("never called")


def test_5_a_callback_with_pl_module_is_refused_when_attached(tmp_path):
    with pytest.raises(CallbackHookError) as err:
        TinyTrainer(quiet_config(tmp_path, callbacks=[LightningStyle()]))
    text = str(err.value)
    assert "LightningStyle.on_train_batch_end" in text
    assert "expected on_train_batch_end(self, trainer, outputs: Any, batch: Any, batch_idx: int)" in text
    assert "found on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx)" in text
    assert "take (trainer, ...) without pl_module" in text

    class FitStart(Callback):
        def on_fit_start(self, trainer, pl_module):
            raise AssertionError("never called")

    t = TinyTrainer(quiet_config(tmp_path))
    with pytest.raises(CallbackHookError, match=r"FitStart.on_fit_start .*expected on_fit_start\(self, trainer\)"):
        t.callbacks.append(FitStart())


def test_5_callbacks_that_take_the_arguments_are_accepted_and_trainer_hooks_are_checked(tmp_path):
    class Loose(Callback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            self.seen = len(args)

        def on_validation_batch_end(self, trainer, outputs, batch, batch_idx, dataloader_idx=0):
            pass

    cb = Loose()
    TinyTrainer(quiet_config(tmp_path, callbacks=[cb])).fit()
    assert cb.seen == 3

    class BadHook(TinyTrainer):
        def on_train_epoch_end(self, trainer):  # a callback's signature on the trainer
            raise AssertionError("never called")

    with pytest.raises(CallbackHookError, match=r"BadHook.on_train_epoch_end .*expected on_train_epoch_end\(self\)"):
        BadHook(quiet_config(tmp_path / "bad")).fit()


# --- 6. a step that backpropagates and steps by itself ---------------------------------------------------------
class RawStep(TinyTrainer):
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.optimizer.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.optimizer.step()


def test_6_a_step_that_steps_by_itself_gets_one_warning_naming_what_is_bypassed(tmp_path):
    t = RawStep(quiet_config(tmp_path, n_epochs=2))
    ref = TinyTrainer(quiet_config(tmp_path / "ref", n_epochs=2))
    with pytest.warns(UserWarning) as record:
        t.fit()
    ref.fit()
    ours = [str(w.message) for w in record if "called optimizer.step() itself" in str(w.message)]
    assert len(ours) == 1  # 8 steps, one warning
    assert "bypasses the trainer's gradient accumulation (gradient_accumulation_steps), gradient clipping" in ours[0]
    assert "Write instead: return the loss" in ours[0]
    assert all_equal(weights(t.model), weights(ref.model))  # it trains, as written
    assert t.global_step == 8


def test_6_self_backward_with_a_raw_optimizer_step_would_step_twice_and_fails(tmp_path):
    class Twice(TinyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.backward(F.mse_loss(self.model(x), y))
            self.optimizer.step()  # Lightning's manual optimization: opt.step()

    with pytest.raises(MisconfigurationError, match=r"Call self.step\(optimizer\) instead of optimizer.step\(\)"):
        Twice(quiet_config(tmp_path)).fit()


# --- 7. max_steps with several optimizers ---------------------------------------------------------------------
def test_7_max_steps_with_two_optimizers_says_it_counts_batches(tmp_path):
    message = (
        "max_steps=3 counts training steps (batches), not optimizer steps as in Lightning: with 2 optimizers "
        "Lightning's max_steps=N is max_steps=N/2 here"
    )
    t = GAN(quiet_config(tmp_path / "gan", n_epochs=None, max_steps=3), "dg", "optimizer=")
    with pytest.warns(UserWarning, match=message.replace("(", r"\(").replace(")", r"\)")):
        t.fit()
    assert t.global_step == 3

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        GAN(quiet_config(tmp_path / "no-max", n_epochs=1), "dg", "optimizer=").fit()
        TinyTrainer(quiet_config(tmp_path / "one", n_epochs=None, max_steps=3)).fit()
    assert not [w for w in record if "counts training steps" in str(w.message)]


# --- 8. Lightning's data hooks and conveniences on the trainer -------------------------------------------
class LightningData(DreamTrainer):
    """A LightningModule's data hooks written on the trainer, no configure_dataloaders."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.prepared: list[str] = []
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)
        self.x, self.y = make_regression_data(24, seed=0)

    def prepare_data(self) -> None:
        self.prepared.append(f"rank {self.global_rank}, epoch {self.trainer.current_epoch}")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=4)

    def val_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.x[16:], self.y[16:]), batch_size=4)

    def test_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.x[16:20], self.y[16:20]), batch_size=2)

    def predict_dataloader(self) -> Any:
        return DataLoader(TensorDataset(self.x[:6], self.y[:6]), batch_size=3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def test_8_lightning_data_hooks_on_the_trainer_are_used(tmp_path):
    t = LightningData(quiet_config(tmp_path, n_epochs=2))
    t.fit()
    assert t.prepared == ["rank 0, epoch 0"]  # once, before setup
    assert t.global_step == 8  # 16 samples / 4 per batch, 2 epochs: train_dataloader() was used
    assert "val_loss" in t.callback_metrics  # val_dataloader() too
    assert t.test()["test_loss"] == pytest.approx(F.mse_loss(t.model(t.x[16:20]), t.y[16:20]).item(), rel=1e-6)
    assert [p.shape[0] for p in t.predict()] == [3, 3]


def test_8_self_trainer_print_and_logger_as_in_lightning(tmp_path, capsys):
    from dream_trainer import MemoryLogger

    logger = MemoryLogger()
    t = TinyTrainer(quiet_config(tmp_path, loggers=[logger, MemoryLogger()]))
    assert t.trainer is t and t.logger is logger
    t.print("only on rank zero", 3)
    assert capsys.readouterr().out == "only on rank zero 3\n"
    assert TinyTrainer(quiet_config(tmp_path / "none", loggers=[])).logger is None


@pytest.mark.parametrize(
    ("method", "says"),
    [
        ("training_epoch_end", "training_epoch_end: Lightning 1.x's; define on_train_epoch_end(self)"),
        ("optimizer_step", "optimizer_step: not called (defining it is an error at setup)"),
        ("configure_callbacks", "configure_callbacks: not called (defining it is an error at setup): list the"),
    ],
)
def test_8_lightning_methods_never_called_here_fail_at_setup(tmp_path, method, says):
    cls = type("Ported", (TinyTrainer,), {method: lambda self, *a, **k: None})
    t = cls(quiet_config(tmp_path))
    with pytest.raises(MisconfigurationError, match="defines Lightning methods that dream_trainer never calls") as err:
        t.fit()
    assert says in str(err.value)
    assert t.global_step == 0


class SkipFrom(Callback):
    """Returns -1 from on_train_batch_start at batch `at` of every epoch (Lightning's signal)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.ended: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, batch, batch_idx):
        return -1 if batch_idx == self.at else None

    def on_train_batch_end(self, trainer, outputs, batch, batch_idx):
        self.ended.append((trainer.current_epoch, batch_idx))


def test_8_on_train_batch_start_returning_minus_one_skips_the_rest_of_the_epoch(tmp_path):
    skip = SkipFrom(at=2)
    t = TinyTrainer(quiet_config(tmp_path, n_epochs=2, callbacks=[skip]))
    t.fit()
    assert skip.ended == [(0, 0), (0, 1), (1, 0), (1, 1)]  # batches 2 and 3 of each epoch: not trained
    assert t.global_step == 4 and len(t.train_losses) == 4 and t.current_epoch == 2


def test_8_minus_one_inside_an_accumulation_window_steps_what_was_accumulated(tmp_path):
    skip = SkipFrom(at=1)  # windows of 2: the first window has one batch when the epoch is cut
    t = TinyTrainer(quiet_config(tmp_path, n_epochs=2, gradient_accumulation_steps=2, callbacks=[skip]))
    before = t.model.weight.detach().clone()
    t.fit()
    assert t.global_step == 2  # one (short) window per epoch, closed at the epoch's end
    assert not torch.equal(t.model.weight, before)


class ZeroesAfterStep(TinyTrainer):
    """Lightning's manual-optimization habit: zero_grad() after each step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.backward(F.mse_loss(self.model(x), y))
        self.step(self.optimizer)
        self.optimizer.zero_grad()


def test_9_zero_grad_in_the_step_with_accumulation_fails_at_the_first_step(tmp_path):
    t = ZeroesAfterStep(quiet_config(tmp_path, gradient_accumulation_steps=2))
    before = t.model.weight.detach().clone()
    with pytest.raises(MisconfigurationError, match=r"calls zero_grad\(\) on optimizer, which erases the gradients"):
        t.fit()
    assert torch.equal(t.model.weight, before)
    assert "zero_grad" not in vars(t.optimizer)  # the watch is removed


def test_9_zero_grad_in_the_step_without_accumulation_is_harmless_and_allowed(tmp_path):
    t = ZeroesAfterStep(quiet_config(tmp_path))
    t.fit()
    assert t.global_step == 4 and "zero_grad" not in vars(t.optimizer)


def test_9_lightning_names_the_trainer_lacks_say_what_to_write(tmp_path):
    class ParametersOfSelf(TinyTrainer):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)  # a LightningModule's habit

    with pytest.raises(AttributeError, match=r"not an nn.Module, it holds them; call it on a model, e.g. `self.model"):
        ParametersOfSelf(quiet_config(tmp_path / "a")).fit()

    class ManualBackward(TinyTrainer):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.manual_backward(F.mse_loss(self.model(x), y))

    with pytest.raises(AttributeError, match=r"'manual_backward' \(Lightning's LightningModule has\): here it is"):
        ManualBackward(quiet_config(tmp_path / "b")).fit()

    class Typo(TinyTrainer):
        def training_step(self, batch, batch_idx):
            return self.nope

    with pytest.raises(AttributeError, match=r"^'Typo' object has no attribute 'nope'$"):
        Typo(quiet_config(tmp_path / "c")).fit()


def test_9_max_steps_warning_grammar(tmp_path):
    t = GAN(quiet_config(tmp_path, max_steps=1), "gd", "toggle")
    with pytest.warns(UserWarning, match=r"Keep max_steps=1 if you meant 1 batch; silence this"):
        t.fit()


# --- 10. evaluation needs no training parts, as in Lightning -------------------------------------------
class EvalOnly(DreamTrainer):
    """A model to evaluate: no training_step, no optimizer, no training data."""

    def configure_models(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(4, 1)

    def val_dataloader(self) -> Any:
        x, y = make_regression_data(8, seed=2)
        return DataLoader(TensorDataset(x, y), batch_size=4)

    def test_dataloader(self) -> Any:
        return self.val_dataloader()

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"test_loss": F.mse_loss(self.model(x), y)}

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])


def test_10_validate_test_predict_need_no_training_step_optimizer_or_training_data(tmp_path):
    t = EvalOnly(quiet_config(tmp_path))
    x, y = make_regression_data(8, seed=2)
    assert t.validate()["val_loss"] == pytest.approx(t.test()["test_loss"])
    with torch.no_grad():
        expected = F.mse_loss(t.model(x), y).item()
    assert t.test()["test_loss"] == pytest.approx(expected, rel=1e-6)
    assert [p.shape for p in t.predict(t.val_dataloader())] == [(4, 1), (4, 1)]


def test_10_fit_still_says_what_is_missing(tmp_path):
    t = EvalOnly(quiet_config(tmp_path / "a"))
    with pytest.raises(MisconfigurationError, match=r"EvalOnly has no training_step: define"):
        t.fit()
    assert not t.is_setup  # said before any model was built

    class NoOptimizer(EvalOnly):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.model(x), y)

    t = NoOptimizer(quiet_config(tmp_path / "b"))
    assert "test_loss" in t.test()  # evaluation first: fine
    with pytest.raises(MisconfigurationError, match=r"NoOptimizer has no optimizer: assign one"):
        t.fit()
    t = NoOptimizer(quiet_config(tmp_path / "c"))
    with pytest.raises(MisconfigurationError, match=r"NoOptimizer has no optimizer"):
        t.fit()

    class NoTrainingData(NoOptimizer):
        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

    with pytest.raises(MisconfigurationError, match=r"returned no training loader"):
        NoTrainingData(quiet_config(tmp_path / "d")).fit()


class Stages(Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def setup(self, trainer, stage):
        self.seen.append(f"setup {stage}")

    def teardown(self, trainer, stage):
        self.seen.append(f"teardown {stage}")


def test_10_setup_and_teardown_get_each_entry_points_stage(tmp_path):
    stages = Stages()

    class Recording(EvalOnly):
        def setup(self, stage):
            self.mine = [*getattr(self, "mine", []), stage]

    t = Recording(quiet_config(tmp_path / "a", callbacks=[stages]))
    t.test()
    t.test()
    t.validate()
    assert stages.seen == ["setup test", "teardown test"] * 2 + ["setup validate", "teardown validate"]
    assert t.mine == ["test", "test", "validate"]  # the trainer's own hook too

    stages = Stages()
    trained = TinyTrainer(quiet_config(tmp_path / "b", callbacks=[stages]))
    trained.fit()
    trained.validate()
    assert stages.seen == ["setup fit", "teardown fit", "setup validate", "teardown validate"]
