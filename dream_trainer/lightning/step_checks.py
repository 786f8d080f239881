"""The first training step of each `fit()`, checked for what ported Lightning code gets wrong, and the
step signatures Lightning allows.

`StepMixin` reaches this module at two seams: at setup, `adapt_step` reads each step's signature once;
and the step's one visible branch (`StepMixin._step_body`, taken on the first step of each fit)
runs the user's `training_step` under a `FirstStepCheck`, which then judges it. Later steps take the
other branch and pay nothing here.

- `step_output_problem`: a return value the trainer cannot use (a string, a non-scalar loss, ...);
- `BYPASSED` / `WRITE_INSTEAD`: the words for a step that calls `loss.backward()` / `optimizer.step()`
  itself;
- `GradientRouting`: with several optimizers, a `self.backward(loss)` whose gradients reach the
  parameters of an optimizer the loss was not meant for (a GAN's generator loss reaching the
  discriminator's step);
- `max_steps_note`: with several optimizers, `max_steps` counts batches here, optimizer steps in Lightning;
- `skipped_note`: a first step that returned None (a skipped batch): said once, and the next step checked;
- `adapt_step`: a step written without `batch_idx` (read once, at setup).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError
from dream_trainer.utils.step_outputs import loss_of
from dream_trainer.utils.warn import warn_user

ACCEPTED_OUTPUTS = (
    "accepted: a scalar loss tensor (the trainer calls self.backward on it); a dict with a scalar loss "
    'tensor under "loss" (its other scalar entries are logged); or, after calling self.backward(loss) in '
    "the step, None or a dict of metrics"
)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        grad = "" if value.requires_grad else ", requires_grad=False"
        return f"a tensor of shape {tuple(value.shape)} (dtype {value.dtype}{grad})"
    text = repr(value)
    return f"a {type(value).__qualname__} ({text if len(text) <= 60 else text[:57] + '...'})"


def step_output_problem(outputs: Any, backward_called: bool) -> str | None:
    """What is wrong with `outputs` as the return value of a `training_step` (None: nothing).
    `backward_called`: the step called `self.backward` (or stepped an optimizer) itself."""
    if isinstance(outputs, torch.Tensor):
        loss = outputs
    elif isinstance(outputs, Mapping):
        if "loss" not in outputs:
            if backward_called:
                return None
            return (
                f'a dict without a "loss" entry (keys {sorted(map(str, outputs))}) and did not call '
                "self.backward(loss): nothing would be backpropagated"
            )
        loss = outputs["loss"]
        if not isinstance(loss, torch.Tensor):
            if backward_called and isinstance(loss, (int, float)) and not isinstance(loss, bool):
                return None  # a number logged as "loss" after backpropagating it
            return f'a dict whose "loss" is {_describe(loss)}, not a scalar tensor'
        if loss.numel() != 1:
            return f'a dict whose "loss" is {_describe(loss)}, not a scalar (reduce it, e.g. .mean())'
    elif outputs is None:
        return None if backward_called else "None without calling self.backward(loss): nothing was backpropagated"
    else:
        return _describe(outputs)
    if loss.numel() != 1:
        return f"{_describe(loss)}, not a scalar (reduce it, e.g. .mean())"
    if not backward_called and not loss.requires_grad:
        return (
            f"a loss that does not require grad ({_describe(loss)}): it was computed under torch.no_grad() "
            "or detached, so it cannot be backpropagated"
        )
    return None


def _positional_arity(fn: Callable[..., Any]) -> tuple[int, int | None]:
    """`(required, accepted)` positional arguments of a bound method; `accepted` None: any (`*args`)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: call it as written
        return 0, None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return required, None
    return required, len(positional)


def adapt_step(owner: str, method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the loops call it, `(batch, batch_idx, *dataloader_idx)`: a step written without
    `batch_idx` (Lightning allows it) gets a wrapper that drops it; others are returned unchanged.
    Read once, at setup: the signature is never inspected per batch."""
    required, accepted = _positional_arity(fn)
    if accepted is not None and accepted < 1:
        raise MisconfigurationError(f"{owner}.{method} takes no batch: define `def {method}(self, batch, batch_idx):`.")
    if method == "training_step" and required > 2:
        raise MisconfigurationError(
            f"{owner}.training_step{inspect.signature(fn)} needs {required} arguments, but the trainer passes "
            "(batch, batch_idx): define `def training_step(self, batch, batch_idx):`. (Lightning 1.x's "
            "optimizer_idx is gone: call self.step(optimizer) for each optimizer inside the step.)"
        )
    if accepted != 1:
        return fn

    def without_batch_idx(batch: Any, batch_idx: int, *dataloader_idx: int) -> Any:
        return fn(batch)

    return without_batch_idx


BYPASSED = (
    "the trainer's gradient accumulation (gradient_accumulation_steps), gradient clipping "
    "(gradient_clip_val, clip_gradients), fp16 loss scaling, the non-finite gradient policy, the "
    "on_before_backward/on_after_backward/on_before_optimizer_step hooks and per-step LR schedulers"
)
WRITE_INSTEAD = (
    "return the loss (the trainer backpropagates and steps), or call self.backward(loss) and "
    "self.step(optimizer) (manual optimization; the trainer zeroes gradients): no loss.backward(), "
    "optimizer.step() or optimizer.zero_grad() of your own"
)
WRITE_INSTEAD_CLOSURE = (
    "return the loss (the trainer builds the closure and calls optimizer.step(closure)), or call "
    "self.step(optimizer, closure=closure) with a closure that calls self.backward(loss) and returns the loss: "
    "no loss.backward(), optimizer.step(closure) or optimizer.zero_grad() of your own"
)


class GradientRouting:
    """Watches one `training_step` call with several optimizers: which optimizers' parameters each
    unscoped `self.backward(loss)` put gradients on, and which optimizers were stepped after it.

    A backward "belongs" to the optimizers stepped right after it (before the next backward). When it
    also put gradients on optimizer B outside that group, and B then steps with those gradients still
    there (later in the batch, or at the end of an accumulation window, which zeroes nothing between its
    batches), B's update contains a loss meant for another optimizer: Lightning's GAN example, stepping
    the generator first, would move the discriminator by the generator's loss. `leaks()` names them.

    Costs two passes over the parameters per backward, on the first step of a fit only.
    """

    def __init__(self, optimizers: tuple[Optimizer, ...], names: Callable[[Optimizer], str]) -> None:
        self._optimizers = optimizers
        self._name = names
        self._before: dict[int, tuple[int, int] | None] = {}
        # ("backward", optimizers it put gradients on) or ("step", optimizer), in call order
        self.events: list[tuple[str, Any]] = []

    def _grads(self) -> dict[int, tuple[int, int] | None]:
        # A gradient is new (id) or accumulated in place (the tensor's version counter moves).
        return {
            id(p): None if p.grad is None else (id(p.grad), p.grad._version)
            for o in self._optimizers
            for g in o.param_groups
            for p in g["params"]
        }

    def before_backward(self) -> None:
        self._before = self._grads()

    def after_backward(self) -> None:
        after = self._grads()
        touched = {
            o
            for o in self._optimizers
            if any(after[id(p)] != self._before[id(p)] for g in o.param_groups for p in g["params"])
        }
        self.events.append(("backward", touched))

    def stepped(self, optimizer: Optimizer) -> None:
        self.events.append(("step", optimizer))

    def leaks(self, window_continues: bool) -> list[str]:
        """One sentence per backward whose gradients reach an optimizer it does not belong to, which then
        steps with them. `window_continues`: this batch is not the last of its accumulation window."""
        found: list[str] = []
        stepped_at = [(i, o) for i, (kind, o) in enumerate(self.events) if kind == "step"]
        for i, (kind, touched) in enumerate(self.events):
            if kind != "backward":
                continue
            owners: list[Optimizer] = []
            for _, later in self.events[i + 1 :]:
                if not isinstance(later, Optimizer):
                    break  # the next backward starts another group
                owners.append(later)
            if not owners:
                continue
            for other in touched - set(owners):
                later_step = any(j > i and o is other for j, o in stepped_at)
                any_step = any(o is other for _, o in stepped_at)
                if later_step or (window_continues and any_step):
                    when = "later in the batch" if later_step else "at the end of the accumulation window"
                    first = self._name(owners[0])
                    found.append(
                        f"self.backward(loss) before self.step({first}) also put gradients on the parameters "
                        f"of {self._name(other)}, which steps {when} with them: that loss moves "
                        f"{self._name(other)} too. Write self.backward(loss, optimizer=self.{first}), or "
                        f"compute the loss inside `with self.toggle_optimizer(self.{first}):`"
                    )
        return found


def skipped_note(owner: str, batch_idx: int) -> str:
    """The warning, once per `fit()`, for a first step that returned None and backpropagated nothing: the
    batch was skipped (a documented skip, e.g. right after a resume), or the step forgot `return loss`."""
    return (
        f"{owner}.training_step returned None without self.backward(loss) at the first step of this fit() "
        f"(batch {batch_idx}): that batch trained nothing. Return the loss if it should have trained; a skip on "
        "purpose is fine. (Said once per fit(); the next step that returns something is checked.)"
    )


def max_steps_note(n_optimizers: int, max_steps: int | None) -> str | None:
    """With several optimizers, the warning that `max_steps` counts training steps (batches) here, where
    Lightning counts optimizer steps (a migrated value trains twice as long); None otherwise."""
    if n_optimizers < 2 or max_steps is None:
        return None
    batches = "batch" if max_steps == 1 else "batches"
    return (
        f"max_steps={max_steps} counts training steps (batches), not optimizer steps as in Lightning: with "
        f"{n_optimizers} optimizers Lightning's max_steps=N is max_steps=N/{n_optimizers} here (when every batch "
        f"steps each optimizer). Keep max_steps={max_steps} if you meant {max_steps} {batches}; silence this with "
        'warnings.filterwarnings("ignore", message="max_steps=")'
    )


class FirstStepCheck:
    """Watches the user's `training_step` on the first step of a `fit()`, then judges what it did.

    While `watching()` (and the trainer's `_watching(check)`) are open it records, without replacing any
    method of the trainer: every optimizer step (torch's post-step hooks), the `self.step(optimizer)`
    calls that stepped through the trainer, what each unscoped `self.backward(loss)` reached (with several
    optimizers), and, with gradient accumulation, any `optimizer.zero_grad()` the step makes. `judge()`
    then raises or warns: `zero_grad()` inside an accumulation window, a loss that reaches another
    optimizer's parameters, a raw `loss.backward()` / `optimizer.step()`, a return value the trainer
    cannot use.
    """

    def __init__(
        self, owner: str, optimizers: tuple[Optimizer, ...], names: Callable[[Optimizer], str], accumulation: int
    ) -> None:
        self._owner = owner
        self._optimizers = optimizers
        self._names = names
        self._accumulation = accumulation
        self._routing = GradientRouting(optimizers, names) if len(optimizers) > 1 else None
        self._all_steps = 0  # optimizer steps, however made
        self._closure_seen = False  # an optimizer stepped with a closure (LBFGS): the advice names that form
        self._trainer_steps = 0  # those made by self.step(optimizer) at a window's end
        self._zeroed: list[Optimizer] = []

    # --- what the trainer's backward/step report (`OptimizationMixin.StepWatch`) ----------------------
    def before_backward(self, scoped: bool) -> None:
        if self._routing is not None and not scoped:  # a scoped backward reaches only what it names
            self._routing.before_backward()

    def after_backward(self, scoped: bool) -> None:
        if self._routing is not None and not scoped:
            self._routing.after_backward()

    def stepping(self, optimizer: Optimizer, window_end: bool) -> None:
        if self._routing is not None:
            self._routing.stepped(optimizer)
        if window_end:
            self._trainer_steps += 1

    # --- what the optimizers report ------------------------------------------------------------------
    def _on_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._all_steps += 1
        # torch's post-step hooks see the step's call: `args` starts with the optimizer itself.
        if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
            self._closure_seen = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around the user's step: count optimizer steps; with accumulation, record `zero_grad()` calls.

        The `zero_grad` record is the one thing torch offers no hook for: for this one call each optimizer
        object gets an instance attribute `zero_grad` that records and calls the class's method; it is
        deleted on the way out (an optimizer whose `zero_grad` the user shadowed already is left alone)."""
        handles = [opt.register_step_post_hook(self._on_step) for opt in self._optimizers]
        recorded: list[Optimizer] = []
        if self._accumulation > 1:
            for opt in self._optimizers:
                if "zero_grad" in vars(opt):
                    continue

                def recording(*args: Any, _opt: Optimizer = opt, **kwargs: Any) -> None:
                    self._zeroed.append(_opt)
                    type(_opt).zero_grad(_opt, *args, **kwargs)

                opt.zero_grad = recording  # type: ignore[method-assign]  # this one call only (see the docstring)
                recorded.append(opt)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for opt in recorded:
                del opt.zero_grad

    def judge(
        self,
        outputs: Any,
        *,
        backward_in_step: bool,
        manual_step: bool,
        window_pos: int,
        window_end: bool,
        any_grad: Callable[[], bool],
    ) -> bool:
        """Raise or warn about what the watched step did (see the class docstring). False when the step
        skipped its batch: it returned None and backpropagated and stepped nothing, which is how a step
        skips a batch (and what a step that forgot `return loss` does). That says nothing about what the
        step returns when it trains, so the caller checks the next step instead (`skipped_note`)."""
        if self._zeroed:
            names = ", ".join(sorted({self._names(o) for o in self._zeroed}))
            raise MisconfigurationError(
                f"{self._owner}.training_step calls zero_grad() on {names}, which erases the gradients "
                f"accumulated over the window (gradient_accumulation_steps={self._accumulation}): the trainer "
                "zeroes every optimizer at the start of each window, and self.step(optimizer) acts only at its "
                "end. Remove the zero_grad() call. (Checked on the first step of each fit().)"
            )
        if self._routing is not None:
            leaks = self._routing.leaks(window_continues=not window_end)
            if leaks:
                warn_user(
                    f"{self._owner}.training_step: " + "; ".join(leaks) + ". (Checked on the first step of each fit().)"
                )
        raw_step = self._all_steps > self._trainer_steps
        raw_backward = not backward_in_step and window_pos == 1 and any_grad()
        if raw_step or raw_backward:
            self._bypass_problem(outputs, raw_step, backward_in_step, manual_step)
            return True
        if outputs is None and not (backward_in_step or manual_step):
            return False  # a skipped batch: judge the next step
        problem = step_output_problem(outputs, backward_in_step or manual_step)
        if problem is not None:
            raise MisconfigurationError(
                f"{self._owner}.training_step returned {problem}; {ACCEPTED_OUTPUTS}. "
                "(Checked on the first step of each fit().)"
            )
        return True

    def _bypass_problem(self, outputs: Any, raw_step: bool, backward_in_step: bool, manual_step: bool) -> None:
        """The step backpropagated or stepped an optimizer by itself (`loss.backward()`,
        `optimizer.step()`): an error where the trainer would then do it twice or never step, else
        one warning naming what the trainer no longer does."""
        name = self._owner
        closure = self._closure_seen
        write_instead = WRITE_INSTEAD_CLOSURE if closure else WRITE_INSTEAD
        stepped = "optimizer.step(closure)" if closure else "optimizer.step()"
        did = f"called {stepped}" if raw_step else "called loss.backward() (gradients appeared)"
        if loss_of(outputs) is not None and not backward_in_step:
            raise MisconfigurationError(
                f"{name}.training_step {did} itself and also returned the loss, which the trainer would "
                f"backpropagate a second time. Write instead: {write_instead}."
            )
        if raw_step and backward_in_step and not manual_step:
            instead = (
                "self.step(optimizer, closure=closure) instead of optimizer.step(closure)"
                if closure
                else "self.step(optimizer) instead of optimizer.step() (and drop optimizer.zero_grad())"
            )
            raise MisconfigurationError(
                f"{name}.training_step called self.backward(loss) and then {stepped} itself: the trainer, "
                f"seeing no self.step(...), would step every optimizer a second time. Call {instead}."
            )
        if not raw_step and not manual_step:
            raise MisconfigurationError(
                f"{name}.training_step called loss.backward() itself but stepped no optimizer and returned "
                f"no loss: nothing would ever update the weights. Write instead: {WRITE_INSTEAD}."
            )
        if raw_step:
            bypassed, instead = BYPASSED, write_instead
        else:  # loss.backward() with self.step(...): only the backward's share is bypassed
            bypassed = (
                "the accumulation window's loss averaging (gradient_accumulation_steps), fp16 loss scaling "
                "and the on_before_backward/on_after_backward hooks"
            )
            instead = "call self.backward(loss) instead of loss.backward()"
        warn_user(
            f"{name}.training_step {did} itself: training runs, but bypasses {bypassed}. "
            f"Write instead: {instead}. (Checked on the first step of each fit().)"
        )
