"""OptimizationMixin: `backward`, `step`, `clip_gradients`, non-finite gradient policies and LR scheduler
stepping, run inside the accumulation window.

The window itself is one object (`dream_trainer.accumulation.AccumulationWindow`, the trainer's `_window`):
its position, its flags, its transitions, the `no_sync` decision and its checkpoint entry are its own.
This mixin registers it among the run's state owners ("accumulation"), zeroes the gradients when a window
opens, tells it what `backward` and the optimizer steps did, and steps the optimizers at its end.

Lightning's `configure_optimizers` return forms and the state of `toggle_optimizer()` are read by an
`OptimizerForms` object it holds (`dream_trainer/lightning/optimizer_forms.py`, composition): one call at
setup (`_register_returned`), and the public methods below ask it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError, NonFiniteGradientError
from dream_trainer.lightning.optimizer_forms import OptimizerForms, ToggledOptimizer
from dream_trainer.mixins.bad_batches import BadBatchMixin
from dream_trainer.run_state import StateOwner
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


def clip_order(optimizer: Optimizer, models: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The parameters of `optimizer` in the order their gradient norm is summed: the order of
    `model.parameters()` of the first of `models` that holds them all, so that `gradient_clip_val` gives
    the norm of `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` bit for bit (an optimizer's
    groups, decay and no-decay, list them in another order, and a float sum depends on its order);
    the param-group order when no one model holds them all (an optimizer over several models)."""
    in_groups = [p for g in optimizer.param_groups for p in g["params"]]
    wanted = {id(p) for p in in_groups}
    for model in models:
        ordered: list[torch.Tensor] = [p for p in model.parameters() if id(p) in wanted]
        if len(ordered) == len(wanted):
            return ordered
    return in_groups


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


class _LRAtStep:
    """Writes the trainer's `lr_at_step(step)` into every param group of its optimizers. Held among the
    per-step schedulers of each optimizer (`_schedulers_by_optimizer`), so it runs after every optimizer
    step, where it writes the next step's rate, and costs nothing to a trainer without `lr_at_step`."""

    def __init__(self, rate: Callable[[int], float | None], optimizers: tuple[Optimizer, ...], loop: Any) -> None:
        self._rate = rate
        self._optimizers = optimizers
        self._loop = loop

    def write(self, step: int) -> None:
        """Set every group's `"lr"` to `lr_at_step(step)` (left as it is when that returns None)."""
        lr = self._rate(step)
        if lr is None:
            return
        for opt in self._optimizers:
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # a tensor lr (capturable/fused): kept a tensor
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr

    def step(self) -> None:
        # After an optimizer step of training step `global_step` (not yet advanced): the next one's rate.
        self.write(self._loop.global_step + 1)


class StepWatch(Protocol):
    """What watches `backward` and `step` during one watched call (see `OptimizationMixin._watching`):
    the first-step checks of `dream_trainer/lightning/step_checks.py`."""

    def before_backward(self, scoped: bool) -> None: ...

    def after_backward(self, scoped: bool) -> None: ...

    def stepping(self, optimizer: Optimizer, window_end: bool) -> None: ...


class OptimizationMixin(BadBatchMixin):
    """Turns `backward`/`step` calls into Lightning-style optimization with accumulation.

    An accumulation window is `gradient_accumulation_steps` consecutive batches (fewer at the end of
    an epoch). At its first batch every optimizer's gradients are zeroed; `step(optimizer)` acts only
    at its last batch; `global_step` advances once per window.
    """

    def _init_optimization(self) -> None:
        cfg = self.config
        self._clip_val: float | None = cfg.gradient_clip_val
        self._clip_algorithm: str = cfg.gradient_clip_algorithm
        self._non_finite: str = cfg.non_finite_grads
        self._check_finite = cfg.non_finite_grads != "ignore"
        self._step_schedulers = cfg.scheduler_interval == "step"
        self._pending_clip: dict[Optimizer, tuple[float, str]] = {}
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.non_finite_counts: dict[str, int] = {"skipped": 0, "retried": 0}
        # Lightning's configure_optimizers return forms and toggle_optimizer's frozen parameters.
        self._optimizer_forms: OptimizerForms = OptimizerForms()
        # What watches backward/step during one call (the first step of a fit); None otherwise.
        self._watch: StepWatch | None = None
        # Set at setup (`_bind_optimizers`): optimizers that step only with a closure (LBFGS), the
        # parameter order of each optimizer's gradient norm, and the writer of `lr_at_step`.
        self._closure_optimizers: frozenset[Optimizer] = frozenset()
        self._clip_orders: dict[Optimizer, tuple[tuple[tuple[int, int], ...], list[torch.Tensor]]] = {}
        self._lr_writer: _LRAtStep | None = None
        self._state_owners.register(
            "optimization",
            StateOwner(self._optimization_entries, self._load_non_finite_counts, self._copy_counts, self._put_counts),
        )
        window = self._window  # the accumulation window (created by TrainerCore, which the loop reads)
        self._state_owners.register(
            "accumulation", StateOwner(self._window_entries, self._load_window, window.snapshot, window.restore)
        )

    # --- run state (see `dream_trainer.run_state`) ----------------------------------------------------
    def _window_entries(self) -> dict[str, Any]:
        # Inside a window each rank's gradients are its own (not yet synchronised): every rank's is kept.
        gather = self.all_gather_object if self.is_distributed else None
        return self._window.state_dict(self.named_models(), gather, self.global_rank)

    def _load_window(self, checkpoint: Mapping[str, Any]) -> None:
        self._window.load_state_dict(checkpoint, self.named_models(), self.global_rank, self.world_size)

    def _optimization_entries(self) -> dict[str, Any]:
        return {"counters": {"non_finite_counts": dict(self.non_finite_counts)}}

    def _load_non_finite_counts(self, checkpoint: Mapping[str, Any]) -> None:
        self.non_finite_counts.update(checkpoint.get("counters", {}).get("non_finite_counts", {}))

    def _copy_counts(self) -> tuple[dict[str, int], dict[str, torch.Tensor], dict[Optimizer, tuple[float, str]]]:
        return dict(self.non_finite_counts), dict(self.grad_norms), dict(self._pending_clip)

    def _put_counts(self, saved: tuple[dict[str, int], dict[str, torch.Tensor], dict[Any, Any]]) -> None:
        non_finite_counts, grad_norms, pending_clip = saved
        self.non_finite_counts.clear()
        self.non_finite_counts.update(non_finite_counts)
        self.grad_norms.clear()
        self.grad_norms.update(grad_norms)
        self._pending_clip.clear()
        self._pending_clip.update(pending_clip)

    @contextlib.contextmanager
    def _schedulers_held(self) -> Iterator[None]:
        """Per-step schedulers do not step inside the block (a tuning run sets the learning rate)."""
        step_schedulers, self._step_schedulers = self._step_schedulers, False
        try:
            yield
        finally:
            self._step_schedulers = step_schedulers

    def _note_backward(self) -> None:
        """Gradients were computed outside `backward` (a pipeline schedule's): as if it was called."""
        self._window.note_backward()

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
        self._lr_writer = None
        if type(self).lr_at_step is not OptimizationMixin.lr_at_step:
            self._lr_writer = _LRAtStep(self.lr_at_step, self._optimizer_list, self._loop)
            if schedulers:
                sched_name, sched = schedulers[0]
                raise MisconfigurationError(
                    f"{type(self).__name__}.lr_at_step and the scheduler self.{sched_name} both set the learning "
                    f"rate of self.{self.optimizer_name(sched.optimizer)}: keep one (remove the scheduler, or "
                    "lr_at_step, which gives every step's rate itself)."
                )
            for opt in self._optimizer_list:  # it writes the next step's rate after every optimizer step
                by_opt.setdefault(opt, []).append(self._lr_writer)
        self._schedulers_by_optimizer = {o: tuple(s) for o, s in by_opt.items()}
        self._scheduler_list = tuple(per_epoch)  # those stepped at the end of each epoch
        self._step_schedulers = bool(by_opt)
        self._clip_orders = {}
        self._closure_optimizers = frozenset(o for o in self._optimizer_list if needs_closure(o))
        for opt in self._closure_optimizers:
            problem = closure_conflicts(self.config, self.optimizer_name(opt), type(opt).__name__)
            if problem is not None:
                raise MisconfigurationError(problem)

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

    def optimizer_name(self, optimizer: Optimizer) -> str:
        """The attribute name `optimizer` was assigned to (`"optimizer"` for one the trainer does not hold)."""
        return self._optimizer_names.get(optimizer, "optimizer")

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
        window = self._window
        window.note_manual_step()
        if self._watch is not None:  # the first step of a fit (see `_watching`)
            self._watch.stepping(optimizer, window.end)
        if closure is not None:
            return self._closure_step(optimizer, closure)
        if not window.end:
            return None
        return self._optimizer_step(optimizer)

    def lr_at_step(self, step: int) -> float | None:
        """Override to give the learning rate of training step `step` (0-based: `global_step` when the
        step starts), e.g. a warmup and cosine decay. The trainer writes it into `param_group["lr"]` of
        every param group of every optimizer before that step, as a plain loop sets
        `param_group["lr"] = lr` (bit for bit the same): at the start of `fit()`, then after each
        optimizer step for the next one. Return None to leave the rates as they are. It replaces an LR
        scheduler (a trainer with both is refused at setup). Not overridden: the trainer never calls it.
        """
        return None

    def _start_lr_at_step(self) -> None:
        """At the start of `fit()` (after a resume): the rate of the step about to run."""
        if self._lr_writer is not None:
            self._lr_writer.write(self._loop.global_step)

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

    # --- the window's edges (the window is `self._window`: see dream_trainer.accumulation) ----------
    def _zero_grads(self) -> None:
        """A window opens: every optimizer's gradients go (`on_before_zero_grad` first)."""
        hooks = self._bus.on_before_zero_grad
        for opt in self._optimizer_list:
            for fn in hooks:
                fn(opt)
            opt.zero_grad(set_to_none=True)

    def _auto_step(self) -> None:
        """Step every optimizer when `training_step` backpropagated but stepped none itself."""
        window = self._window
        if window.backward and not window.manual_step:
            for opt in self._optimizer_list:
                self._optimizer_step(opt)

    def _end_window(self) -> None:
        """The window's optimizer steps are done: the fp16 scale updates, the loop counts the training step."""
        window = self._window
        if window.scaler_unscaled and self.grad_scaler is not None:
            self.grad_scaler.update()
        window.finish()
        self._loop.count_step()

    def _close_window(self) -> None:
        """At an epoch's end: a window the loader ended inside (a loader without a length) ends with the
        micro-batch run last: the optimizers step and the training step counts."""
        if self._window.close():
            self._auto_step()
            self._end_window()

    def _reset_window_for_retry(self) -> None:
        """The batch runs again (non_finite_grads="retry"): counted, its window starts over."""
        if self.grad_scaler is not None and self._window.scaler_unscaled:
            self.grad_scaler.update()  # lower the scale before trying again
        for opt in self._optimizer_list:
            opt.zero_grad(set_to_none=True)
        self._window.restart()
        self._pending_clip.clear()
        self.non_finite_counts["retried"] += 1

    # --- one optimizer step -----------------------------------------------------------------------
    def _optimizer_step(self, optimizer: Optimizer) -> torch.Tensor | None:
        marks = self._step_marks
        if marks is not None:  # a hang watchdog runs: clipping reduces the gradient norm across ranks
            marks.mark("optimizer step")
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
            self._window.note_unscaled()
        clip, algorithm = self._clip_val, self._clip_algorithm
        if self._pending_clip:
            clip, algorithm = self._pending_clip.pop(optimizer, (clip, algorithm))
        norm: torch.Tensor | None = None
        if clip is not None or self._check_finite:
            norm = self._clip_grads(optimizer, clip, algorithm)
            if norm is not None:
                self.grad_norms[self._optimizer_names.get(optimizer, "optimizer")] = norm
                # SYNC: only with a non-finite policy, which the user turned on.
                if self._check_finite and not bool(torch.isfinite(norm)):
                    self._non_finite_step(optimizer)
                    return norm
        if self._spike_skip and self._spike_skips_step():  # spike_policy="skip" (decided in _check_spike)
            self._drop_step(optimizer)
            return norm
        for fn in self._bus.on_before_optimizer_step:
            fn(optimizer)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            try:
                optimizer.step()
            except TypeError as exc:  # free when nothing is raised (Python 3.11)
                if optimizer in self._closure_optimizers:
                    raise MisconfigurationError(self._closure_needed(optimizer)) from exc
                raise
        self._window.note_step()
        if self._step_schedulers:
            for sched in self._schedulers_by_optimizer.get(optimizer, ()):
                self._step_scheduler(sched)
        return norm

    def _clip_params(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """`optimizer`'s parameters in the order its gradient norm sums them (`clip_order`), computed once
        and again only when its param groups change (`add_param_group`, a finetuning callback)."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        cached = self._clip_orders.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        order = clip_order(optimizer, [unwrap(m) for _, m in self.named_models()])
        self._clip_orders[optimizer] = (key, order)
        return order

    def _clip_grads(self, optimizer: Optimizer, clip: float | None, algorithm: str) -> torch.Tensor | None:
        """Clip `optimizer`'s gradients (`clip` None: only measure them); their total norm, None when it
        has no gradient."""
        params = [p for p in self._clip_params(optimizer) if p.grad is not None]
        if not params:
            return None
        if algorithm == "value" and clip is not None:
            self.parallel.clip_grads_by_value_(params, clip)
        # The strategy knows how the gradients are split (FSDP shards, TP meshes, PP stages).
        norm = self.parallel.total_grad_norm([p.grad for p in params if p.grad is not None])
        if clip is not None and algorithm == "norm":
            self.parallel.clip_grads_with_norm_(params, clip, norm)
        return norm

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
        """`optimizer.step(closure)`: each call of `closure` zeroes `optimizer`'s gradients
        (`on_before_zero_grad` first) and runs `evaluate` (which backpropagates through `self.backward`),
        then clips the gradients and applies the non-finite policy; `on_before_optimizer_step` fires
        after the first call, whose gradient norm is the one kept in `grad_norms`. `first`: the loss of a
        first evaluation already made (the automatic step's `training_step`, already backpropagated),
        which the first call returns instead of evaluating again. Returns what `optimizer.step` returns."""
        name = self.optimizer_name(optimizer)
        if self._window.steps != 1 or self.grad_scaler is not None:
            raise MisconfigurationError(
                closure_conflicts(self.config, name, type(optimizer).__name__)
                or f"self.step(self.{name}, closure=...) cannot run here."
            )
        clip, algorithm = self._clip_val, self._clip_algorithm
        if self._pending_clip:
            clip, algorithm = self._pending_clip.pop(optimizer, (clip, algorithm))
        measure = clip is not None or self._check_finite
        bus = self._bus
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
                norm = self._clip_grads(optimizer, clip, algorithm)
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

        result = optimizer.step(closure)
        self._window.note_step()
        if self._step_schedulers:
            for sched in self._schedulers_by_optimizer.get(optimizer, ()):
                self._step_scheduler(sched)
        return result

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
        self._record_skipped("non_finite", self._window_batches())
        self._drop_step(optimizer)

    def _drop_step(self, optimizer: Optimizer) -> None:
        """This window's step of `optimizer` is dropped (a non-finite or a spike skip): its gradients go."""
        optimizer.zero_grad(set_to_none=True)
        if self._lr_writer is not None:  # the next step still gets its own rate
            self._lr_writer.step()

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
