"""GradientNormMonitor: log gradient norms on logging steps, as the optimizer is about to use them."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import torch

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError
from dream_trainer.utils.modules import unwrap

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from dream_trainer.protocol import TrainerProtocol


class GradientNormMonitor(Callback):
    """Log the gradient norm of each optimizer's parameters every `log_every_n_steps` training steps.

    The norm is taken in `on_before_optimizer_step`, so it is the gradient the optimizer applies:
    after fp16 unscaling, after clipping, summed over the whole accumulation window. Steps that do not
    log compute nothing; the norms stay on the device and are read back with the other metrics.

    Args:
        norm_type: the p of the p-norm (2.0 by default; `float("inf")` or `"inf"` for the max norm).
        per_layer: also log the norm of each parameter's gradient, as `grad_norm/<param name>`, where
            the name is the parameter's path from the trainer (e.g. `grad_norm/model.weight`).
        log_every_n_steps: logging cadence in training steps (default: `config.log_every_n_steps`).

    Keys: `grad_norm/<optimizer attribute name>` (e.g. `grad_norm/optimizer`), logged at the step the
    gradient belongs to, `k` for the k-th step, next to the training metrics flushed at `k`.
    """

    def __init__(
        self,
        norm_type: float | int | str = 2.0,
        per_layer: bool = False,
        log_every_n_steps: int | None = None,
    ) -> None:
        if isinstance(norm_type, str) and norm_type.lower() in ("inf", "infinity"):
            norm_type = math.inf
        if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:
            raise ConfigError(
                f"GradientNormMonitor(norm_type={norm_type!r}) is invalid: expected a positive number or 'inf'"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ConfigError(
                f"GradientNormMonitor(log_every_n_steps={log_every_n_steps!r}) is invalid: "
                "expected a positive integer or None"
            )
        self.norm_type: float = float(norm_type)
        self.per_layer: bool = per_layer
        self.log_every_n_steps: int | None = log_every_n_steps
        self._every: int = log_every_n_steps or 0  # resolved from the config at setup
        self._param_names: dict[int, str] | None = None

    def setup(self, trainer: TrainerProtocol, stage: str) -> None:
        self._every = self.log_every_n_steps or trainer.config.log_every_n_steps
        self._param_names = None  # models are (re)built after this hook

    def on_before_optimizer_step(self, trainer: TrainerProtocol, optimizer: Optimizer) -> None:
        # The hook fires before `global_step` counts this step: it is step `global_step + 1`.
        step = trainer.global_step + 1
        if step % (self._every or trainer.config.log_every_n_steps):
            return
        norms = self.compute_norms(trainer, optimizer)
        if norms:
            trainer.log_metrics(norms, step=step)

    def compute_norms(self, trainer: TrainerProtocol, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        """The gradient norms of `optimizer`'s parameters now, as `{key: 0-dim tensor}` (no sync)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return {}
        name = trainer.optimizer_name(optimizer)
        grads = [p.grad for p in params]
        out: dict[str, torch.Tensor] = {}
        if self.per_layer:
            names = self._names(trainer)
            layer_norms = [_full(torch.linalg.vector_norm(g, self.norm_type)) for g in grads]
            for i, (p, norm) in enumerate(zip(params, layer_norms, strict=True)):
                out[f"grad_norm/{names.get(id(p), f'{name}.param{i}')}"] = norm
        out[f"grad_norm/{name}"] = self._total(trainer, grads)
        return out

    def _total(self, trainer: TrainerProtocol, grads: list[torch.Tensor]) -> torch.Tensor:
        # The strategy's norm, as for clipping: on a device mesh the gradients are DTensors on several
        # meshes (TP-sharded weights on ("dp_shard", "tp"), the rest on "dp_shard"), which one
        # `get_total_norm` cannot stack, and pipeline stages hold different parameters.
        parallel = getattr(trainer, "parallel", None)
        if parallel is not None:
            norm: torch.Tensor = parallel.total_grad_norm(grads, self.norm_type)
            return norm
        return _full(torch.nn.utils.get_total_norm(grads, self.norm_type))

    def _names(self, trainer: TrainerProtocol) -> dict[int, str]:
        if self._param_names is None:
            self._param_names = {
                id(p): f"{model_name}.{param_name}"
                for model_name, model in trainer.named_models()
                for param_name, p in unwrap(model).named_parameters()
            }
        return self._param_names


def _full(t: torch.Tensor) -> torch.Tensor:
    # A sharded (FSDP2 DTensor) norm holds one shard's part: make it the whole norm (a collective,
    # run on every rank at the same logging step).
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
