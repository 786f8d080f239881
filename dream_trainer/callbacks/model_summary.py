"""ModelSummary: a table of every model's modules, parameter counts and sizes, printed at fit start."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError
from dream_trainer.utils.modules import unwrap

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol

_MB = 1e6  # sizes are in megabytes (10**6 bytes), as Lightning's summary


def _is_lazy(t: torch.Tensor) -> bool:
    # Lazy modules (nn.LazyLinear) have no shape until their first forward: they count as 0.
    return isinstance(t, (UninitializedParameter, UninitializedBuffer))


def _numel(t: torch.Tensor) -> int:
    return 0 if _is_lazy(t) else t.numel()


def _nbytes(t: torch.Tensor) -> int:
    return 0 if _is_lazy(t) else t.numel() * t.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:  # tied weights count once
            seen.add(id(t))
            out.append(t)
    return out


def _stats(params: list[torch.Tensor], buffers: list[torch.Tensor]) -> dict[str, Any]:
    total = sum(_numel(p) for p in params)
    trainable = sum(_numel(p) for p in params if p.requires_grad)
    size = sum(_nbytes(t) for t in params) + sum(_nbytes(t) for t in buffers)
    return {"params": total, "trainable_params": trainable, "size_mb": size / _MB}


class ModelSummary(Callback):
    """Print a summary of the trainer's models when `fit()` starts (global rank zero only).

    One table: for every model of the trainer (`trainer.named_models()`), a row for the model itself and
    one per submodule down to `max_depth` levels, each with its name, type, parameter count, trainable
    parameter count and size (parameters and buffers, in MB = 10**6 bytes); then the totals over all
    models (parameters shared between models counted once). Compiled / DDP wrappers are looked
    through, so names are the ones of your module.

    Args:
        max_depth: submodule levels to list; 0 lists only the models, -1 every level.

    `summarize(trainer)` returns the rows as dicts without printing; `totals(trainer)` the totals.
    """

    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigError(
                f"ModelSummary(max_depth={max_depth!r}) is invalid: expected -1 (every level), 0 (models only) "
                "or a positive integer"
            )
        self.max_depth = max_depth

    # --- data -------------------------------------------------------------------------------------
    def summarize(self, trainer: TrainerProtocol) -> list[dict[str, Any]]:
        """One dict per row: `model` (trainer attribute), `name` (dotted path, the model's own row is the
        attribute name), `type`, `depth` (0 for the model), `params`, `trainable_params`, `size_mb`."""
        rows: list[dict[str, Any]] = []
        for model_name, wrapped in trainer.named_models():
            model = unwrap(wrapped)
            for path, module in model.named_modules():
                depth = 0 if path == "" else path.count(".") + 1
                if self.max_depth != -1 and depth > self.max_depth:
                    continue
                stats = _stats(list(module.parameters()), list(module.buffers()))
                rows.append(
                    {
                        "model": model_name,
                        "name": model_name if path == "" else f"{model_name}.{path}",
                        "type": type(module).__name__,
                        "depth": depth,
                        **stats,
                    }
                )
        return rows

    @staticmethod
    def totals(trainer: TrainerProtocol) -> dict[str, Any]:
        """`params`, `trainable_params`, `non_trainable_params`, `size_mb` over all models."""
        models = [unwrap(m) for _, m in trainer.named_models()]
        params = _unique(p for m in models for p in m.parameters())
        buffers = _unique(b for m in models for b in m.buffers())
        stats = _stats(params, buffers)
        stats["non_trainable_params"] = stats["params"] - stats["trainable_params"]
        return stats

    # --- printing ---------------------------------------------------------------------------------
    def render(self, trainer: TrainerProtocol, file: Any = None) -> None:
        """Print the table to `file` (default: stdout) with rich."""
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        out = sys.stdout if file is None else file
        # In a terminal rich fits the table to its width; elsewhere (logs, CI, captured output) a fixed
        # wide console keeps every line whole, and no colour codes are written.
        is_tty = hasattr(out, "isatty") and out.isatty()
        console = Console(file=out, width=None if is_tty else 200, highlight=False, soft_wrap=False)
        table = Table(title="Model summary", title_justify="left")
        table.add_column("Name", overflow="fold")
        table.add_column("Type", overflow="fold")
        table.add_column("Params", justify="right")
        table.add_column("Trainable", justify="right")
        table.add_column("Size (MB)", justify="right")
        rows = self.summarize(trainer)
        for i, row in enumerate(rows):
            if i and row["depth"] == 0:
                table.add_section()
            table.add_row(
                escape("  " * row["depth"] + row["name"]),
                escape(row["type"]),
                f"{row['params']:,}",
                f"{row['trainable_params']:,}",
                f"{row['size_mb']:.3f}",
                style="bold" if row["depth"] == 0 else None,
            )
        console.print(table)
        t = self.totals(trainer)
        console.print(
            f"Trainable params: {t['trainable_params']:,}\n"
            f"Non-trainable params: {t['non_trainable_params']:,}\n"
            f"Total params: {t['params']:,}\n"
            f"Total size (MB): {t['size_mb']:.3f}"
        )

    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        if trainer.is_global_zero:
            self.render(trainer)
