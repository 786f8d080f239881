"""What the first training step of each `fit()` is checked for, and how a step's signature is read.

The trainer checks only the first step (the checking wrapper removes itself, see
`StepMixin._arm_step_output_check`), so nothing here costs anything on later steps:

- `step_output_problem`: a return value the trainer cannot use (a string, a non-scalar loss, ...);
- `BYPASSED` / `WRITE_INSTEAD`: the words for a step that calls `loss.backward()` / `optimizer.step()`
  itself;
- `GradientRouting`: with several optimizers, a `self.backward(loss)` whose gradients reach the
  parameters of an optimizer the loss was not meant for (a GAN's generator loss reaching the
  discriminator's step);
- `adapt_step`: a step written without `batch_idx` (read once, at setup).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from dream_trainer.errors import MisconfigurationError


def loss_of(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


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


def ends_epoch(returned: Any) -> bool:
    """Whether an `on_train_batch_start` return value is Lightning's -1 ("skip the rest of the epoch").
    Only called for a hook that returned something other than None."""
    if isinstance(returned, torch.Tensor):
        return returned.numel() == 1 and bool(returned == -1)
    return isinstance(returned, int) and not isinstance(returned, bool) and returned == -1


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
