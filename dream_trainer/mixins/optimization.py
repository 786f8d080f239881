"""OptimizationMixin: accumulation windows, `backward`, `step`, `clip_gradients`, non-finite gradient
policies and LR scheduler stepping.

It owns the accumulation window's flags (`_loss_divisor`, `_window_backward`, `_manual_step`,
`_stepped_in_window`, `_scaler_unscaled`) and everything that reads or writes them, including their
save/restore in a checkpoint written inside a window (`_window_state` / `_restore_window`).

Lightning's `configure_optimizers` return forms and the state of `toggle_optimizer()` are read by an
`OptimizerForms` object it holds (`dream_trainer/lightning/optimizer_forms.py`, composition): one call at
setup (`_register_returned`), and the public methods below ask it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.lightning.optimizer_forms import OptimizerForms, ToggledOptimizer
from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.utils.modules import unwrap


class _RetryBatch(Exception):
    """Raised inside a step to re-run the batch (non_finite_grads="retry"); never escapes the trainer."""


def _fsdp_sharded_params(models: Iterable[torch.nn.Module]) -> frozenset[int]:
    """`id`s of the parameters of every FSDP2-sharded module (`fully_shard`) in `models`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return frozenset()
    return frozenset(
        id(p) for model in models for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()
    )


class StepWatch(Protocol):
    """What watches `backward` and `step` during one watched call (see `OptimizationMixin._watching`):
    the first-step checks of `dream_trainer/lightning/step_checks.py`."""

    def before_backward(self, scoped: bool) -> None: ...

    def after_backward(self, scoped: bool) -> None: ...

    def stepping(self, optimizer: Optimizer, window_end: bool) -> None: ...


class OptimizationMixin(AMPMixin):
    """Turns `backward`/`step` calls into Lightning-style optimization with accumulation.

    An accumulation window is `gradient_accumulation_steps` consecutive batches (fewer at the end of
    an epoch). At its first batch every optimizer's gradients are zeroed; `step(optimizer)` acts only
    at its last batch; `global_step` advances once per window.
    """

    def _init_optimization(self) -> None:
        cfg = self.config
        self._accumulation = cfg.gradient_accumulation_steps
        self._clip_val: float | None = cfg.gradient_clip_val
        self._clip_algorithm: str = cfg.gradient_clip_algorithm
        self._non_finite: str = cfg.non_finite_grads
        self._check_finite = cfg.non_finite_grads != "ignore"
        self._step_schedulers = cfg.scheduler_interval == "step"
        self._pending_clip: dict[Optimizer, tuple[float, str]] = {}
        # The window's flags (see `_clear_window_flags`).
        self._loss_divisor: int = 1  # backward divides the loss by the window's size
        self._manual_step: bool = False
        self._window_backward: bool = False
        self._stepped_in_window: bool = False
        self._scaler_unscaled: bool = False
        self._backward_in_step: bool = False  # the running training_step called backward itself
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.non_finite_counts: dict[str, int] = {"skipped": 0, "retried": 0}
        # Lightning's configure_optimizers return forms and toggle_optimizer's frozen parameters.
        self._optimizer_forms: OptimizerForms = OptimizerForms()
        # What watches backward/step during one call (the first step of a fit); None otherwise.
        self._watch: StepWatch | None = None

    def _latest_metrics(self) -> Mapping[str, float]:
        """The latest reduced metrics, which a `ReduceLROnPlateau` scheduler monitors.

        Implemented by `LoggingMixin` (its `callback_metrics`), the layer above this one.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no metrics to give ReduceLROnPlateau: LoggingMixin implements "
            "_latest_metrics(); compose OptimizationMixin into a trainer that has LoggingMixin (DreamTrainer does)."
        )

    def _bind_optimizers(self, optimizers: list[tuple[str, Optimizer]], schedulers: list[tuple[str, Any]]) -> None:
        # Parameters FSDP2 shards: the graph holds their unsharded copies, so `backward(inputs=...)`
        # cannot name them (see `_scoped_inputs`). Read once, after the models were wrapped.
        self._fsdp_sharded: frozenset[int] = _fsdp_sharded_params(m for _, m in self.named_models())
        self._optimizer_list: tuple[Optimizer, ...] = tuple(o for _, o in optimizers)
        self._optimizer_names: dict[Optimizer, str] = {o: n for n, o in optimizers}
        # Split once here by interval, so a step only looks up its optimizer's per-step schedulers.
        by_opt: dict[Optimizer, list[Any]] = {}
        per_epoch: list[Any] = []
        for _, sched in schedulers:
            if self.scheduler_interval(sched) == "step":
                by_opt.setdefault(sched.optimizer, []).append(sched)
            else:
                per_epoch.append(sched)
        self._schedulers_by_optimizer = {o: tuple(s) for o, s in by_opt.items()}
        self._scheduler_list = tuple(per_epoch)  # those stepped at the end of each epoch
        self._step_schedulers = bool(by_opt)

    def _scoped_inputs(self, optimizer: Optimizer) -> list[torch.Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if self._fsdp_sharded and any(id(p) in self._fsdp_sharded for p in params):
            name = self.optimizer_name(optimizer)
            raise MisconfigurationError(
                f"self.backward(loss, optimizer=self.{name}) cannot keep the loss to {name}'s parameters: FSDP2 "
                "shards them, and the autograd graph holds their unsharded copies, so they cannot be named as "
                f"backward inputs. Compute the loss and backpropagate it inside `with self.toggle_optimizer("
                f"self.{name}):` instead (it freezes the other optimizers' parameters before the forward)."
            )
        if not params:
            raise MisconfigurationError(
                f"self.backward(loss, optimizer={self.optimizer_name(optimizer)}) has no trainable parameter to "
                "compute gradients for: that optimizer's parameters are all frozen (requires_grad=False). "
                "Unfreeze them, or backpropagate for another optimizer."
            )
        return params

    # --- public verbs -----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: Optimizer | None = None, **kwargs: Any) -> None:
        """Backpropagate `loss`: averaged over the accumulation window, scaled under fp16.

        With `optimizer`, gradients are computed only for that optimizer's parameters
        (`loss.backward(inputs=...)`): a generator loss given `optimizer=self.g_optimizer` leaves the
        discriminator's gradients untouched, in any order of losses and steps and across an
        accumulation window. Fires `on_before_backward(loss)` and `on_after_backward()`. Extra keyword
        arguments (`retain_graph=True`, ...) go to `torch.Tensor.backward`.
        """
        if optimizer is not None:
            kwargs["inputs"] = self._scoped_inputs(optimizer)
        watch = self._watch
        if watch is not None:  # the first step of a fit (see `_watching`)
            watch.before_backward("inputs" in kwargs)
        for fn in self._bus.on_before_backward:
            fn(loss)
        if self._loss_divisor != 1:
            loss = loss / self._loss_divisor
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        if self._sync_models and not self._loop.window_end:
            # Inside an accumulation window: no gradient all-reduce until its last micro-batch.
            with self._no_sync(self._sync_models):
                loss.backward(**kwargs)
        else:
            loss.backward(**kwargs)
        self._backward_in_step = True
        self._window_backward = True
        if watch is not None:
            watch.after_backward("inputs" in kwargs)
        for fn in self._bus.on_after_backward:
            fn()

    def optimizer_name(self, optimizer: Optimizer) -> str:
        """The attribute name `optimizer` was assigned to (`"optimizer"` for one the trainer does not hold)."""
        return self._optimizer_names.get(optimizer, "optimizer")

    def step(self, optimizer: Optimizer) -> torch.Tensor | None:
        """Step `optimizer` at the end of an accumulation window (inside one, do nothing).

        Unscales (fp16), clips (config, or an earlier `clip_gradients`), applies the non-finite policy,
        fires `on_before_optimizer_step`, steps, and steps its schedulers when they step per step.
        Returns the total gradient norm when it was computed (clipping by norm or a non-finite check).
        Calling it marks the step as manual: the trainer will not step other optimizers for you.
        """
        self._manual_step = True
        if self._watch is not None:  # the first step of a fit (see `_watching`)
            self._watch.stepping(optimizer, self._loop.window_end)
        if not self._loop.window_end:
            return None
        return self._optimizer_step(optimizer)

    @contextlib.contextmanager
    def _watching(self, watch: StepWatch) -> Iterator[None]:
        """Tell `watch` about every `backward` and `step` call inside the block (the first training step
        of each fit, checked by `dream_trainer.lightning.step_checks.FirstStepCheck`)."""
        self._watch = watch
        try:
            yield
        finally:
            self._watch = None

    # --- Lightning's optimizer methods (the forms are read by `OptimizerForms`) -----------------------
    def _register_returned(self, returned: Any) -> None:
        """Assign what `configure_optimizers` returned (Lightning's forms, or None) to `self`, where
        discovery finds it: optimizers as `optimizer`, `optimizer_1`, ...; schedulers as `lr_scheduler`,
        ... (or a scheduler dict's `"name"`). Objects the method also assigned keep their attribute."""
        self._optimizer_forms.register(self, returned)

    def scheduler_interval(self, scheduler: Any) -> str:
        """When `scheduler` steps: `"step"` (after each optimizer step) or `"epoch"` (at each epoch's end).
        Its `"interval"` when `configure_optimizers` returned it in a dict, else `config.scheduler_interval`."""
        options = self._optimizer_forms.scheduler_options.get(id(scheduler))
        return options[0] if options is not None else self.config.scheduler_interval

    def optimizers(self) -> Optimizer | list[Optimizer]:
        """The optimizers, in the order they were assigned or returned by `configure_optimizers`: one
        optimizer when there is one, else a list (Lightning's `self.optimizers()`)."""
        opts = [o for _, o in self.named_optimizers()]
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The LR schedulers, in order: None when there is none, the scheduler when there is one, else a
        list (Lightning's `self.lr_schedulers()`)."""
        scheds = [s for _, s in self.named_schedulers()]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def toggle_optimizer(self, optimizer: Optimizer) -> ToggledOptimizer:
        """Freeze (`requires_grad=False`) every parameter of the other optimizers that `optimizer` does
        not also hold, until `untoggle_optimizer(optimizer)`, or the end of the `with` block:

            with self.toggle_optimizer(self.g_optimizer):
                g_loss = F.softplus(-self.discriminator(self.generator(z))).mean()
                self.backward(g_loss)
            self.step(self.g_optimizer)

        A loss computed inside then puts no gradient on the discriminator, whatever the order of the
        losses and steps, as Lightning's `toggle_optimizer`. The forward must run inside (autograd
        records `requires_grad` when the graph is built). `self.backward(loss, optimizer=...)` does the
        same without touching `requires_grad`.
        """
        bound: tuple[Optimizer, ...] | None = getattr(self, "_optimizer_list", None)  # None before setup
        others = bound if bound is not None else tuple(o for _, o in self.named_optimizers())
        return self._optimizer_forms.toggle(optimizer, others)

    toggled_optimizer = toggle_optimizer  # Lightning 2.5's name for the context-manager form

    def untoggle_optimizer(self, optimizer: Optimizer) -> None:
        """Give back `requires_grad` to the parameters `toggle_optimizer(optimizer)` froze."""
        self._optimizer_forms.untoggle(optimizer)

    def clip_gradients(self, optimizer: Optimizer, max_norm: float, algorithm: str = "norm") -> None:
        """Clip `optimizer`'s gradients at its next step: to total norm `max_norm`, or by value.

        Clipping happens inside `step()`, after fp16 unscaling and at the end of the accumulation
        window, so the whole window's gradient is clipped once. It replaces `gradient_clip_val`
        for that step.
        """
        if algorithm not in ("norm", "value"):
            raise ValueError(f"clip_gradients(algorithm={algorithm!r}) is invalid: valid choices are 'norm', 'value'")
        if not max_norm > 0:
            raise ValueError(f"clip_gradients(max_norm={max_norm!r}) is invalid: expected a positive number")
        self._pending_clip[optimizer] = (float(max_norm), algorithm)

    # --- windows ----------------------------------------------------------------------------------
    def _begin_window(self, batch_idx: int, epoch_len: int | None) -> None:
        size = self._accumulation
        if epoch_len is not None and 0 <= batch_idx < epoch_len:
            # The last window of an epoch may be short; average over the batches it really has.
            size = min(size, epoch_len - batch_idx)
        self._loop.window_size = size
        self._loss_divisor = size
        self._clear_window_flags()
        hooks = self._bus.on_before_zero_grad
        for opt in self._optimizer_list:
            for fn in hooks:
                fn(opt)
            opt.zero_grad(set_to_none=True)

    def _auto_step(self) -> None:
        """Step every optimizer when `training_step` backpropagated but stepped none itself."""
        if self._window_backward and not self._manual_step:
            for opt in self._optimizer_list:
                self._optimizer_step(opt)

    def _end_window(self) -> None:
        if self.grad_scaler is not None and self._scaler_unscaled:
            self.grad_scaler.update()
        loop = self._loop
        loop.window_pos = 0
        loop.global_step += 1

    def _reset_window_for_retry(self) -> None:
        if self.grad_scaler is not None and self._scaler_unscaled:
            self.grad_scaler.update()  # lower the scale before trying again
        for opt in self._optimizer_list:
            opt.zero_grad(set_to_none=True)
        self._clear_window_flags()
        self._pending_clip.clear()

    def _clear_window_flags(self) -> None:
        self._manual_step = False  # training_step called self.step: no automatic stepping
        self._window_backward = False  # some backward happened in this window
        self._stepped_in_window = False  # an optimizer already stepped (a retry would step it twice)
        self._scaler_unscaled = False  # the fp16 scaler recorded inf checks: update() is due

    # --- a checkpoint inside a window ---------------------------------------------------------------
    def _window_state(self) -> dict[str, Any] | None:
        """A checkpoint inside an accumulation window keeps the gradients accumulated so far."""
        if not self._loop.window_pos:
            return None
        grads = {
            name: {
                pn: p.grad.detach().to("cpu", copy=True) for pn, p in unwrap(m).named_parameters() if p.grad is not None
            }
            for name, m in self.named_models()
        }
        return {
            "pos": self._loop.window_pos,
            "size": self._loop.window_size,
            "manual_step": self._manual_step,
            "backward": self._window_backward,
            "grads": grads,
        }

    def _restore_window(self, window: dict[str, Any] | None) -> None:
        """Continue the window `_window_state()` saved (on a mid-epoch resume, before its next batch)."""
        if window is None:
            return
        self._loop.window_pos = window["pos"]
        self._loop.window_size = self._loss_divisor = window["size"]
        self._manual_step = window["manual_step"]
        self._window_backward = window["backward"]
        self._stepped_in_window = False
        self._scaler_unscaled = False
        for name, model in self.named_models():
            saved = window["grads"].get(name, {})
            for pn, p in unwrap(model).named_parameters():
                p.grad = saved[pn].to(p.device) if pn in saved else None

    # --- one optimizer step -----------------------------------------------------------------------
    def _optimizer_step(self, optimizer: Optimizer) -> torch.Tensor | None:
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
            self._scaler_unscaled = True
        clip, algorithm = self._clip_val, self._clip_algorithm
        if self._pending_clip:
            clip, algorithm = self._pending_clip.pop(optimizer, (clip, algorithm))
        norm: torch.Tensor | None = None
        if clip is not None or self._check_finite:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if params:
                if algorithm == "value" and clip is not None:
                    self.parallel.clip_grads_by_value_(params, clip)
                # The strategy knows how the gradients are split (FSDP shards, TP meshes, PP stages).
                norm = self.parallel.total_grad_norm([p.grad for p in params if p.grad is not None])
                if clip is not None and algorithm == "norm":
                    self.parallel.clip_grads_with_norm_(params, clip, norm)
                self.grad_norms[self._optimizer_names.get(optimizer, "optimizer")] = norm
                # SYNC: only with a non-finite policy, which the user turned on.
                if self._check_finite and not bool(torch.isfinite(norm)):
                    self._non_finite_step(optimizer)
                    return norm
        for fn in self._bus.on_before_optimizer_step:
            fn(optimizer)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
        self._stepped_in_window = True
        if self._step_schedulers:
            for sched in self._schedulers_by_optimizer.get(optimizer, ()):
                self._step_scheduler(sched)
        return norm

    def _non_finite_step(self, optimizer: Optimizer) -> None:
        name = self._optimizer_names.get(optimizer, "optimizer")
        if self._non_finite == "raise":
            raise NonFiniteGradientError(
                f"non-finite gradients for optimizer {name!r} at global_step {self._loop.global_step} "
                "(config.non_finite_grads='raise'). Set non_finite_grads='skip' to drop such steps or "
                "'retry' to re-run the batch; lower the learning rate or clip gradients if it recurs."
            )
        if self._non_finite == "retry" and not self._stepped_in_window:
            raise _RetryBatch(name)
        # "skip", or "retry" after another optimizer already stepped on this batch: re-running the
        # batch would step that one twice, so drop only this optimizer's update.
        self.non_finite_counts["skipped"] += 1
        optimizer.zero_grad(set_to_none=True)

    # --- schedulers -------------------------------------------------------------------------------
    def _step_scheduler(self, scheduler: Any) -> None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            options = self._optimizer_forms.scheduler_options.get(id(scheduler))
            monitor = options[1] if options is not None else self.config.scheduler_monitor
            metrics = self._latest_metrics()
            if monitor not in metrics:
                where = "config.scheduler_monitor" if options is None else "the monitor configure_optimizers returned"
                raise KeyError(
                    f"ReduceLROnPlateau needs {where}={monitor!r} in trainer.callback_metrics, "
                    f"which holds {sorted(metrics)}. Return or log that metric, or set scheduler_monitor."
                )
            scheduler.step(metrics[monitor])
        else:
            scheduler.step()

    def _step_epoch_schedulers(self) -> None:
        for sched in self._scheduler_list:  # only the per-epoch ones (see `_bind_optimizers`)
            self._step_scheduler(sched)
