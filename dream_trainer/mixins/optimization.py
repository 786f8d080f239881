"""OptimizationMixin: `backward` and `step` inside the accumulation window, and Lightning's optimizer methods.

The window itself is one object (`dream_trainer.accumulation.AccumulationWindow`, the trainer's `_window`):
its position, its flags, its transitions, the `no_sync` decision and its checkpoint entry are its own.
This mixin registers it among the run's state owners ("accumulation"), zeroes the gradients when a window
opens, tells it what `backward` and the optimizer steps did, and steps the optimizers at its end. One
optimizer's step (clipping, the non-finite policy, the closure step of LBFGS) is `OptimizerStepMixin`'s
(`dream_trainer.mixins.optimizer_step`); the learning rate's schedule is `SchedulerMixin`'s
(`dream_trainer.mixins.schedulers`).

Lightning's `configure_optimizers` return forms and the state of `toggle_optimizer()` are read by an
`OptimizerForms` object it holds (`dream_trainer/lightning/optimizer_forms.py`, composition): one call at
setup (`_register_returned`), and the public methods below ask it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError
from dream_trainer.fault_tolerance import FaultTolerance, StepNotCommitted
from dream_trainer.lightning.optimizer_forms import OptimizerForms, ToggledOptimizer
from dream_trainer.mixins.optimizer_step import OptimizerStepMixin
from dream_trainer.run_state import StateOwner


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


class OptimizationMixin(OptimizerStepMixin):
    """Turns `backward`/`step` calls into Lightning-style optimization with accumulation.

    An accumulation window is `gradient_accumulation_steps` consecutive batches (fewer at the end of
    an epoch). At its first batch every optimizer's gradients are zeroed; `step(optimizer)` acts only
    at its last batch; `global_step` advances once per window.
    """

    _fault_tolerance: FaultTolerance | None
    """Per-step fault tolerance (`dream_trainer.fault_tolerance`), None without the setting: created by
    `DreamTrainer._init_fault_tolerance`; `_auto_step` commits each step through it."""

    def _init_optimization(self) -> None:
        self._init_schedulers()
        self._init_optimizer_step()  # clipping, the non-finite policy; registers "optimization"
        # Lightning's configure_optimizers return forms and toggle_optimizer's frozen parameters.
        self._optimizer_forms: OptimizerForms = OptimizerForms()
        # What watches backward/step during one call (the first step of a fit); None otherwise.
        self._watch: StepWatch | None = None
        window = self._window  # the accumulation window (created by TrainerCore, which the loop reads)
        self._state_owners.register(
            "accumulation", StateOwner(self._window_entries, self._load_window, window.snapshot, window.restore)
        )

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def _window_entries(self) -> dict[str, Any]:
        # Inside a window each rank's gradients are its own (not yet synchronised, or its shard): every rank's
        # is kept, gathered on global rank zero, the one that writes the file (not on every rank: under
        # FSDP that would put every rank's shards, a whole gradient, on each rank's CPU).
        gather = self.parallel.gather_object if self.is_distributed else None
        return self._window.state_dict(self.named_models(), gather, self.global_rank)

    def _load_window(self, checkpoint: Mapping[str, Any]) -> None:
        self._window.load_state_dict(checkpoint, self.named_models(), self.global_rank, self.world_size)

    def _note_backward(self) -> None:
        """Gradients were computed outside `backward` (a pipeline schedule's): as if it was called."""
        self._window.note_backward()

    def _bind_optimizers(self, optimizers: list[tuple[str, Optimizer]], schedulers: list[tuple[str, Any]]) -> None:
        # Parameters FSDP2 shards: the graph holds their unsharded copies, so `backward(inputs=...)`
        # cannot name them (see `_scoped_inputs`). Read once, after the models were wrapped.
        self._fsdp_sharded: frozenset[int] = _fsdp_sharded_params(m for _, m in self.named_models())
        self._bind_optimizer_steps(optimizers, schedulers)  # names, schedulers, closure checks (may refuse)

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
        watch, bus, window, marks = self._watch, self._bus, self._window, self._step_marks
        if marks is not None:  # a hang watchdog runs: a DDP rank waits here for the others' gradients
            marks.mark("backward")
        if watch is not None:  # the first step of a fit (see `_watching`)
            watch.before_backward("inputs" in kwargs)
        for fn in bus.on_before_backward:
            fn(loss)
        if window.divisor != 1:
            loss = loss / window.divisor
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        if window.no_sync:
            # Inside an accumulation window: no gradient all-reduce until its last micro-batch.
            with self._no_sync(self._sync_models):
                loss.backward(**kwargs)
        elif kwargs:
            loss.backward(**kwargs)
        else:
            loss.backward()
        window.note_backward()
        if watch is not None:
            watch.after_backward("inputs" in kwargs)
        for fn in bus.on_after_backward:
            fn()

    def step(self, optimizer: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """Step `optimizer` at the end of an accumulation window (inside one, do nothing).

        Unscales (fp16), clips (config, or an earlier `clip_gradients`), applies the non-finite policy,
        fires `on_before_optimizer_step`, steps, and steps its schedulers when they step per step.
        Returns the total gradient norm when it was computed (clipping by norm or a non-finite check).
        Calling it marks the step as manual: the trainer will not step other optimizers for you.

        With `closure` (a function that computes the loss, calls `self.backward(loss)` and returns the
        loss), the step is `optimizer.step(closure)`, as `torch.optim.LBFGS` needs: before each call of
        `closure` the trainer zeroes `optimizer`'s gradients (`on_before_zero_grad` first); after it,
        it clips them and applies the non-finite policy; `on_before_optimizer_step` fires once, after
        the first call. It returns what `optimizer.step(closure)` returns (LBFGS: the first call's loss);
        the gradient norm of the first call is in `grad_norms`. Needs `gradient_accumulation_steps=1` and
        no fp16 loss scaler.
        """
        if self._fault_tolerance is not None:
            raise MisconfigurationError(
                f"{type(self).__name__}.training_step called self.step(), which fault_tolerance does not support: a "
                "step commits once, through its quorum, after training_step; return the loss (or call "
                "self.backward(loss)) and let the trainer step the optimizers (docs/fault-tolerance.md)."
            )
        window = self._window
        window.note_manual_step()
        if self._watch is not None:  # the first step of a fit (see `_watching`)
            self._watch.stepping(optimizer, window.end)
        if closure is not None:
            return self._closure_step(optimizer, closure)
        if not window.end:
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

    # --- the window's edges (the window is `self._window`: see dream_trainer.accumulation) ----------
    def _zero_grads(self) -> None:
        """A window opens: every optimizer's gradients go (`on_before_zero_grad` first)."""
        hooks = self._bus.on_before_zero_grad
        for opt in self._optimizer_list:
            for fn in hooks:
                fn(opt)
            opt.zero_grad(set_to_none=True)

    def _auto_step(self) -> None:
        """Step every optimizer when `training_step` backpropagated but stepped none itself. This is where a
        step commits: with `fault_tolerance`, first the quorum's vote (`FaultTolerance.commit`, which averages
        the gradients across the replica groups); a step it does not commit raises `StepNotCommitted` before
        any optimizer, scheduler or counter moves."""
        window = self._window
        if window.backward and not window.manual_step:
            ft = self._fault_tolerance
            if ft is not None and not ft.commit(self._ft_parameters()):
                raise StepNotCommitted
            for opt in self._optimizer_list:
                self._optimizer_step(opt)

    def _drop_uncommitted_step(self) -> None:
        """The quorum did not commit the step (`StepNotCommitted`): its gradients go and its window closes
        unfinished; nothing was stepped or counted."""
        if self.grad_scaler is not None and self._window.scaler_unscaled:
            self.grad_scaler.update()
        for opt in self._optimizer_list:
            opt.zero_grad(set_to_none=True)
        self._clipping.drop_pending()
        self._window.discard()

    def _ft_parameters(self) -> list[torch.Tensor]:
        """Every optimizer's parameters, once each, in a fixed order (the cross-group gradient average)."""
        seen: dict[int, torch.Tensor] = {}
        for opt in self._optimizer_list:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _end_window(self) -> bool:
        """The window's optimizer steps are done: the fp16 scale updates, the loop counts the training step.
        True when that step is a logging step (every `log_every_n_steps`): the step flushes its metrics."""
        window = self._window
        if window.scaler_unscaled and self.grad_scaler is not None:
            self.grad_scaler.update()
        window.finish()
        loop = self._loop
        loop.count_step()
        return loop.global_step % loop.log_every_n_steps == 0

    def _close_window(self) -> None:
        """At an epoch's end: a window the loader ended inside (a loader without a length) ends with the
        micro-batch run last: the optimizers step and the training step counts."""
        if self._window.close():
            self._auto_step()
            self._end_window()
