"""OptimizerStepMixin: the trainer's optimizers, and one optimizer's step at an accumulation window's end.

A step (`_optimizer_step`, on the hot path) is dropped first when the bad-batch policy says so (with
`spike_policy="skip"` it asks the policy, `dream_trainer.bad_batches.BadBatchPolicy.drops_step`, before the
unscale: the fp16 scaler's scale stays that of a run without the batch); else it unscales the fp16
gradients, clips them (`gradient_clip_val`, or a pending `clip_gradients`: both held by `self._clipping`, a
`dream_trainer.gradient_clipping.GradientClipping`, which clips with the strategy's gradient norm), applies
the non-finite policy (`non_finite_grads`: raise, drop the step, or re-run the batch through `_RetryBatch`),
fires `on_before_optimizer_step`, steps, then steps that optimizer's per-step schedulers (`SchedulerMixin`).
An optimizer that steps only with a closure (LBFGS) steps through `_closure_step`, which does the same
around each call of the closure. The gradient norms, the pending clips (the clipping object's copy) and the
non-finite counts are this mixin's run state ("optimization"); the batches of a window a non-finite skip
dropped go on the policy's skip list (`skip_window`). When a step runs, and `backward`, are
`OptimizationMixin`'s (`dream_trainer.mixins.optimization`). See `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from dream_trainer.bad_batches import BadBatchPolicy
from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.gradient_clipping import Clip, GradientClipping
from dream_trainer.mixins.amp import AMPMixin
from dream_trainer.mixins.schedulers import SchedulerMixin
from dream_trainer.run_state import StateOwner


class _RetryBatch(Exception):
    """Raised inside a step to re-run the batch (non_finite_grads="retry"); never escapes the trainer."""


def needs_closure(optimizer: Optimizer) -> bool:
    """True for an optimizer whose `step` cannot run without a closure (`torch.optim.LBFGS`, and any
    optimizer whose `step(closure)` has no default): read from its class's signature, once, at setup."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return True
    try:
        param = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin step: nothing to read
        return False
    return param is not None and param.default is inspect.Parameter.empty and param.kind is not param.VAR_KEYWORD


def closure_conflicts(config: Any, name: str, kind: str) -> str | None:
    """Why optimizer `name` (of class `kind`), which steps with a closure, cannot train under `config`
    (None: it can): one line naming the setting and what to write instead, then why."""
    why = "\n  (Its closure evaluates the same batch again, several times, inside optimizer.step.)"
    head = f"self.{name} ({kind}) steps with a closure"
    if config.mixed_precision == "fp16":
        return (
            f"{head}, which fp16's loss scaler cannot step through (torch's GradScaler refuses closures): "
            f"write mixed_precision='bf16' or None.{why}"
        )
    if config.gradient_accumulation_steps != 1:
        return (
            f"{head}, which cannot accumulate gradient_accumulation_steps={config.gradient_accumulation_steps} "
            f"batches into one step: write gradient_accumulation_steps=1 (and a larger batch).{why}"
        )
    if config.non_finite_grads in ("skip", "retry"):
        return (
            f"{head}, whose step non_finite_grads={config.non_finite_grads!r} cannot drop or re-run once it is "
            f"under way: write non_finite_grads='raise' (or 'ignore').{why}"
        )
    if config.spike_policy != "off":
        return (
            f"{head}, whose losses spike_policy={config.spike_policy!r} would not see (the closure's evaluations "
            f"are inside optimizer.step): write spike_policy='off'.{why}"
        )
    return None


class OptimizerStepMixin(SchedulerMixin, AMPMixin):
    """Steps one optimizer with clipping and the non-finite policy; holds the optimizers bound at setup."""

    _bad_batches: BadBatchPolicy
    """The bad-batch policy (`dream_trainer.bad_batches`): the skip list a non-finite skip adds to. Created by
    `StepMixin._init_bad_batches`, which holds it."""
    _spike_drop: Callable[[], bool] | None
    """The policy's `drops_step` with `spike_policy="skip"` (the optimizer step asks it), None otherwise: bound
    once by `StepMixin._init_bad_batches`."""

    def _init_optimizer_step(self) -> None:
        cfg = self.config
        self._non_finite: str = cfg.non_finite_grads
        self._check_finite = cfg.non_finite_grads != "ignore"
        # The configured clip, the pending `clip_gradients` ones and each optimizer's norm order. A non-finite
        # policy checks the norm, so it is measured at every step even without a clip.
        self._clipping = GradientClipping(
            cfg.gradient_clip_val, cfg.gradient_clip_algorithm, self._check_finite, self.parallel, self.named_models
        )
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.non_finite_counts: dict[str, int] = {"skipped": 0, "retried": 0}
        # Set at setup (`_bind_optimizer_steps`): optimizers that step only with a closure (LBFGS).
        self._closure_optimizers: frozenset[Optimizer] = frozenset()
        self._state_owners.register(
            "optimization",
            StateOwner(self._optimization_entries, self._load_non_finite_counts, self._copy_counts, self._put_counts),
        )

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def _optimization_entries(self) -> dict[str, Any]:
        return {"counters": {"non_finite_counts": dict(self.non_finite_counts)}}

    def _load_non_finite_counts(self, checkpoint: Mapping[str, Any]) -> None:
        self.non_finite_counts.update(checkpoint.get("counters", {}).get("non_finite_counts", {}))

    def _copy_counts(self) -> tuple[dict[str, int], dict[str, torch.Tensor], dict[Optimizer, Clip]]:
        return dict(self.non_finite_counts), dict(self.grad_norms), self._clipping.snapshot()

    def _put_counts(self, saved: tuple[dict[str, int], dict[str, torch.Tensor], dict[Any, Any]]) -> None:
        non_finite_counts, grad_norms, pending_clip = saved
        self.non_finite_counts.clear()
        self.non_finite_counts.update(non_finite_counts)
        self.grad_norms.clear()
        self.grad_norms.update(grad_norms)
        self._clipping.restore(pending_clip)

    # --- the optimizers, bound at setup ------------------------------------------------------------
    def _bind_optimizer_steps(self, optimizers: list[tuple[str, Optimizer]], schedulers: list[tuple[str, Any]]) -> None:
        """At setup (`OptimizationMixin._bind_optimizers`): the optimizers by name, their schedulers, and
        the checks of those that step only with a closure."""
        self._optimizer_list: tuple[Optimizer, ...] = tuple(o for _, o in optimizers)
        self._optimizer_names: dict[Optimizer, str] = {o: n for n, o in optimizers}
        self._bind_schedulers(optimizers, schedulers)  # may refuse lr_at_step with a scheduler
        self._clipping.forget_orders()
        self._closure_optimizers = frozenset(o for o in self._optimizer_list if needs_closure(o))
        for opt in self._closure_optimizers:
            problem = closure_conflicts(self.config, self.optimizer_name(opt), type(opt).__name__)
            if problem is not None:
                raise MisconfigurationError(problem)

    def optimizer_name(self, optimizer: Optimizer) -> str:
        """The attribute name `optimizer` was assigned to (`"optimizer"` for one the trainer does not hold)."""
        return self._optimizer_names.get(optimizer, "optimizer")

    # --- clipping and the non-finite policy ---------------------------------------------------------
    def clip_gradients(self, optimizer: Optimizer, max_norm: float, algorithm: str = "norm") -> None:
        """Clip `optimizer`'s gradients at its next step: to total norm `max_norm`, or by value.

        Clipping happens inside `step()`, after fp16 unscaling and at the end of the accumulation
        window, so the whole window's gradient is clipped once. It replaces `gradient_clip_val`
        for that step.
        """
        self._clipping.request(optimizer, max_norm, algorithm)

    def _reset_window_for_retry(self) -> None:
        """The batch runs again (non_finite_grads="retry"): counted, its window starts over."""
        if self.grad_scaler is not None and self._window.scaler_unscaled:
            self.grad_scaler.update()  # lower the scale before trying again
        for opt in self._optimizer_list:
            opt.zero_grad(set_to_none=True)
        self._window.restart()
        self._clipping.drop_pending()
        self.non_finite_counts["retried"] += 1

    # --- one optimizer step -----------------------------------------------------------------------
    def _optimizer_step(self, optimizer: Optimizer) -> torch.Tensor | None:
        marks = self._step_marks
        if marks is not None:  # a hang watchdog runs: clipping reduces the gradient norm across ranks
            marks.mark("optimizer step")
        if self._spike_drop is not None and self._spike_drop():  # asks the bad-batch policy (spike_policy="skip")
            # Before the unscale: the fp16 scaler neither sees the dropped batch's overflow nor counts the
            # window (no `update()`), so its scale is the one of a run whose loader never yielded the batch.
            self._drop_step(optimizer)
            return None
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
            self._window.note_unscaled()
        norm: torch.Tensor | None = None
        clipping = self._clipping
        # Without a clip, a pending `clip_gradients` or a non-finite policy there is nothing to measure: no call.
        if clipping.every_step or clipping.pending:
            norm = clipping.clip_(optimizer)  # takes this optimizer's pending clip
            if norm is not None:
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
            try:
                optimizer.step()
            except TypeError as exc:  # free when nothing is raised (Python 3.11)
                self._refuse_missing_closure(optimizer, exc)
                raise
        self._window.note_step()
        if self._step_schedulers:
            for sched in self._schedulers_by_optimizer.get(optimizer, ()):
                self._step_scheduler(sched)
        return norm

    def _refuse_missing_closure(self, optimizer: Optimizer, exc: TypeError) -> None:
        """`optimizer.step()` raised `exc`: for an optimizer that steps only with a closure (LBFGS), a
        `MisconfigurationError` saying how to give it one; otherwise nothing (the caller re-raises `exc`).
        Out of `_optimizer_step`, which calls it only when the step raised."""
        if optimizer in self._closure_optimizers:
            raise MisconfigurationError(self._closure_needed(optimizer)) from exc

    def _closure_needed(self, optimizer: Optimizer) -> str:
        name = self.optimizer_name(optimizer)
        return (
            f"self.{name} ({type(optimizer).__name__}) steps only with a closure, which the trainer cannot build "
            f"from self.backward(loss): return the loss instead, or call self.step(self.{name}, closure=closure).\n"
            "  Returned, the loss is the closure's first evaluation: the trainer builds the closure around "
            "training_step and calls optimizer.step(closure). Your own closure computes the loss, calls "
            "self.backward(loss) and returns it; the trainer zeroes the gradients before each call."
        )

    def _closure_step(
        self, optimizer: Optimizer, evaluate: Callable[[], Any], first: torch.Tensor | None = None
    ) -> Any:
        """`optimizer.step(closure)`, the closure built by `_step_closure` around `evaluate` (`first`: the
        loss of a first evaluation already made), then `optimizer`'s per-step schedulers. Returns what
        `optimizer.step` returns."""
        if self._window.steps != 1 or self.grad_scaler is not None:
            name = self.optimizer_name(optimizer)
            raise MisconfigurationError(
                closure_conflicts(self.config, name, type(optimizer).__name__)
                or f"self.step(self.{name}, closure=...) cannot run here."
            )
        # Taken once: a pending `clip_gradients` clips every evaluation of this step.
        clip = self._clipping.take(optimizer)
        result = optimizer.step(self._step_closure(optimizer, evaluate, first, clip))
        self._window.note_step()
        if self._step_schedulers:
            for sched in self._schedulers_by_optimizer.get(optimizer, ()):
                self._step_scheduler(sched)
        return result

    def _step_closure(
        self, optimizer: Optimizer, evaluate: Callable[[], Any], first: torch.Tensor | None, clip: Clip
    ) -> Callable[[], Any]:
        """The closure `_closure_step` gives `optimizer.step`: each call zeroes `optimizer`'s gradients
        (`on_before_zero_grad` first) and runs `evaluate` (which backpropagates through `self.backward`),
        then clips the gradients (`clip`) and applies the non-finite policy; `on_before_optimizer_step`
        fires after the first call, whose gradient norm is the one kept in `grad_norms`. `first`: the loss
        of a first evaluation already made (the automatic step's `training_step`, already backpropagated),
        which the first call returns instead of evaluating again."""
        name = self.optimizer_name(optimizer)
        measure = clip[0] is not None or self._check_finite
        bus, clipping = self._bus, self._clipping
        calls = 0

        def closure() -> Any:
            nonlocal calls
            calls += 1
            if calls == 1 and first is not None:
                result: Any = first
            else:
                for fn in bus.on_before_zero_grad:
                    fn(optimizer)
                optimizer.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    result = evaluate()
            if measure:
                norm = clipping.clip_(optimizer, clip)
                if norm is not None:
                    if calls == 1:
                        self.grad_norms[name] = norm
                    # SYNC: only with a non-finite policy ("raise": "skip"/"retry" are refused with a closure).
                    if self._check_finite and not bool(torch.isfinite(norm)):
                        self._non_finite_step(optimizer)
            if calls == 1:
                for fn in bus.on_before_optimizer_step:
                    fn(optimizer)
            return result

        return closure

    def _non_finite_step(self, optimizer: Optimizer) -> None:
        name = self._optimizer_names.get(optimizer, "optimizer")
        if self._non_finite == "raise":
            raise NonFiniteGradientError(
                f"non-finite gradients for optimizer {name!r} at global_step {self._loop.global_step} "
                "(config.non_finite_grads='raise'). Set non_finite_grads='skip' to drop such steps or "
                "'retry' to re-run the batch; lower the learning rate or clip gradients if it recurs."
            )
        if self._non_finite == "retry" and not self._window.stepped:
            raise _RetryBatch(name)
        # "skip", or "retry" after another optimizer already stepped on this batch: re-running the
        # batch would step that one twice, so drop only this optimizer's update.
        self.non_finite_counts["skipped"] += 1
        self._bad_batches.skip_window("non_finite")
        self._drop_step(optimizer)

    def _drop_step(self, optimizer: Optimizer) -> None:
        """This window's step of `optimizer` is dropped (a non-finite or a spike skip): its gradients go."""
        optimizer.zero_grad(set_to_none=True)
        if self._lr_writer is not None:  # the next step still gets its own rate
            self._lr_writer.step()
