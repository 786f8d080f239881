"""`GradientClipping`: what an optimizer step clips its gradients to, as one object the trainer holds.

It owns every piece of gradient clipping: the configured clip (`gradient_clip_val`,
`gradient_clip_algorithm`), the one-step clips `trainer.clip_gradients(optimizer, max_norm)` asked for
(pending until that optimizer's next step takes them), and the order in which each optimizer's gradient
norm sums its parameters (`clip_order`, cached per optimizer). It clips through the trainer's strategy,
which knows how the gradients are split (FSDP shards, TP meshes, PP stages), and returns the total norm:
what the trainer keeps in `grad_norms` and checks against its non-finite policy (neither is clipping's).

The trainer (`OptimizerStepMixin._init_optimizer_step`) creates it once and calls it at a few places:

- `clip_(optimizer)`: at each optimizer step that clips or measures. The step reads `every_step` and
  `pending` (plain attributes) first, so a run without clipping or a non-finite policy makes no call;
- `take(optimizer)` then `clip_(optimizer, clip)`: a closure step (LBFGS) takes its clip once and
  clips every evaluation of the closure with it;
- `request(...)`: `trainer.clip_gradients`; `drop_pending()`: a retried batch starts its window over;
- `forget_orders()`: at setup, when the optimizers are bound (they may be new objects);
- `snapshot()` / `restore(saved)`: the pending clips, in the "optimization" owner's exact copy (a tuning
  run, a rollback). Nothing here reaches a checkpoint: a step end has no pending clip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim import Optimizer

from dream_trainer.utils.modules import unwrap

if TYPE_CHECKING:
    from dream_trainer.parallel.strategy import Strategy

Clip = tuple[float | None, str]
"""`(max_norm, algorithm)` of one step: max_norm None only measures the norm; algorithm "norm" or "value"."""


def clip_order(optimizer: Optimizer, models: Iterable[nn.Module]) -> list[torch.Tensor]:
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


class GradientClipping:
    """The gradient clipping of one trainer (see the module docstring). Read `every_step` and `pending`
    anywhere; they change through its methods only.

    Args:
        max_norm: `gradient_clip_val` (None: no clip but the pending ones).
        algorithm: `gradient_clip_algorithm`, "norm" or "value".
        measure: the norm is wanted at every step even without a clip (a non-finite policy checks it).
        strategy: the trainer's strategy object (`trainer.parallel`), which measures and clips.
        named_models: the trainer's `named_models` (the models whose parameter order a norm follows).

    Attributes:
        every_step: every optimizer step clips or measures (a configured clip, or `measure`).
        pending: `clip_gradients` clips by optimizer, waiting for its next step (empty almost always).
    """

    __slots__ = ("_configured", "_measure", "_named_models", "_orders", "_strategy", "every_step", "pending")

    def __init__(
        self,
        max_norm: float | None,
        algorithm: str,
        measure: bool,
        strategy: Strategy,
        named_models: Callable[[], Iterable[tuple[str, nn.Module]]],
    ) -> None:
        self._configured: Clip = (max_norm, algorithm)
        self._measure = measure
        self.every_step = max_norm is not None or measure
        self.pending: dict[Optimizer, Clip] = {}
        self._strategy = strategy
        self._named_models = named_models
        # By optimizer: its param groups' identity when the order was read, and the order.
        self._orders: dict[Optimizer, tuple[tuple[tuple[int, int], ...], list[torch.Tensor]]] = {}

    # --- what a step clips to -------------------------------------------------------------------------
    def request(self, optimizer: Optimizer, max_norm: float, algorithm: str = "norm") -> None:
        """`trainer.clip_gradients`: clip `optimizer` at its next step, instead of the configured clip."""
        if algorithm not in ("norm", "value"):
            raise ValueError(f"clip_gradients(algorithm={algorithm!r}) is invalid: valid choices are 'norm', 'value'")
        if not max_norm > 0:
            raise ValueError(f"clip_gradients(max_norm={max_norm!r}) is invalid: expected a positive number")
        self.pending[optimizer] = (float(max_norm), algorithm)

    def take(self, optimizer: Optimizer) -> Clip:
        """The clip of `optimizer`'s step now: its pending one (taken: it is for one step), else the
        configured one."""
        return self.pending.pop(optimizer, self._configured) if self.pending else self._configured

    def drop_pending(self) -> None:
        """The window starts over (a retried batch): the clips asked for during it go with it."""
        self.pending.clear()

    # --- clipping ---------------------------------------------------------------------------------------
    def clip_(self, optimizer: Optimizer, clip: Clip | None = None) -> torch.Tensor | None:
        """Clip `optimizer`'s gradients with `clip` (by default taken now: `take`) and return their total
        norm; None when it has no gradient, or when there is nothing to do (no clip for it, and no norm
        wanted: another optimizer's clip is pending)."""
        # `take`, inline: this runs at every step that clips.
        if clip is None:
            clip = self.pending.pop(optimizer, self._configured) if self.pending else self._configured
        max_norm, algorithm = clip
        if max_norm is None and not self._measure:
            return None
        params = [p for p in self.params(optimizer) if p.grad is not None]
        if not params:
            return None
        strategy = self._strategy
        if algorithm == "value" and max_norm is not None:
            strategy.clip_grads_by_value_(params, max_norm)
        # The norm after a clip by value: what the optimizer applies (and what the policy checks).
        norm = strategy.total_grad_norm([p.grad for p in params if p.grad is not None])
        if max_norm is not None and algorithm == "norm":
            strategy.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def params(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """`optimizer`'s parameters in the order its gradient norm sums them (`clip_order`), computed once
        and again only when its param groups change (`add_param_group`, a finetuning callback)."""
        key = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
        cached = self._orders.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        order = clip_order(optimizer, [unwrap(m) for _, m in self._named_models()])
        self._orders[optimizer] = (key, order)
        return order

    def forget_orders(self) -> None:
        """The optimizers were bound (setup): orders are read again at their first step."""
        self._orders = {}

    # --- an exact copy (a tuning run, a rollback) -------------------------------------------------------
    def snapshot(self) -> dict[Optimizer, Clip]:
        """The pending clips as they are now."""
        return dict(self.pending)

    def restore(self, saved: dict[Optimizer, Clip]) -> None:
        """Put back what `snapshot()` returned."""
        self.pending.clear()
        self.pending.update(saved)

    def __repr__(self) -> str:
        max_norm, algorithm = self._configured
        return f"GradientClipping(max_norm={max_norm}, algorithm={algorithm!r}, pending={len(self.pending)})"
