"""What a Lightning-style `configure_optimizers` returns, and the state behind Lightning's
`toggle_optimizer()`.

`OptimizerForms` is held by the trainer (`OptimizationMixin._optimizer_forms`, composition, not a base
class). The core reaches it at one seam at setup, `OptimizationMixin._register_returned`, and through
the trainer's `scheduler_interval()`, `toggle_optimizer()` and `untoggle_optimizer()`, which ask it.
It owns `scheduler_options` (a returned scheduler dict's `interval`/`monitor`) and what
`toggle_optimizer` froze.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from dream_trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from dream_trainer.mixins.core import TrainerCore

_RETURN_FORMS = (
    "return an optimizer; a list of optimizers; `[optimizers], [schedulers]`; "
    '`{"optimizer": opt, "lr_scheduler": sched}` (the scheduler may be a dict `{"scheduler": sched, '
    '"interval": "epoch" or "step", "frequency": 1, "monitor": "val_loss"}`); or a list of such dicts. '
    "Or return nothing and assign them: `self.optimizer = torch.optim.AdamW(...)`, `self.scheduler = ...`"
)
_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "name", "strict")


def _is_scheduler(obj: object) -> bool:
    return isinstance(obj, (LRScheduler, ReduceLROnPlateau))


class ToggledOptimizer:
    """What `toggle_optimizer` returns: leaving its `with` block gives back what it froze."""

    def __init__(self, forms: OptimizerForms, optimizer: Optimizer) -> None:
        self._forms = forms
        self.optimizer = optimizer

    def __enter__(self) -> Optimizer:
        return self.optimizer

    def __exit__(self, *exc: object) -> None:
        self._forms.untoggle(self.optimizer)


class OptimizerForms:
    """Reads `configure_optimizers`' return value (Lightning's forms) and keeps what it says per
    scheduler; freezes and unfreezes parameters for `toggle_optimizer`."""

    def __init__(self) -> None:
        # Per-scheduler `(interval, monitor)` from a returned Lightning scheduler dict, by id(scheduler);
        # schedulers without an entry follow config.scheduler_interval / scheduler_monitor.
        self.scheduler_options: dict[int, tuple[str, str]] = {}
        # The parameters `toggle(optimizer)` froze, to unfreeze on `untoggle(optimizer)`.
        self._toggled: dict[Optimizer, list[torch.Tensor]] = {}

    # --- Lightning's configure_optimizers return forms -----------------------------------------------
    def register(self, trainer: TrainerCore, returned: Any) -> None:
        """Assign what `configure_optimizers` returned to `trainer`, where discovery finds it: optimizers
        as `optimizer`, `optimizer_1`, ...; schedulers as `lr_scheduler`, `lr_scheduler_1`, ... (or a
        scheduler dict's `"name"`). Objects the method also assigned keep their attribute."""
        if returned is None:
            return
        owner = type(trainer).__name__
        optimizers, schedulers = _read(owner, returned)
        known_opts = {id(o) for _, o in trainer.named_optimizers()}
        for opt in optimizers:
            if id(opt) not in known_opts:
                setattr(trainer, _free_name(trainer, "optimizer"), opt)
        known_scheds = {id(s) for _, s in trainer.named_schedulers()}
        returned_opts = {id(o) for o in optimizers} | known_opts
        interval, monitor = trainer.config.scheduler_interval, trainer.config.scheduler_monitor
        for sched, options in schedulers:
            if id(sched.optimizer) not in returned_opts:
                raise _bad(owner, "a scheduler whose optimizer is neither returned nor assigned to the trainer")
            if options:
                self.scheduler_options[id(sched)] = (
                    options.get("interval", interval),
                    options.get("monitor", monitor),
                )
            if id(sched) not in known_scheds:
                name = options.get("name")
                if not (
                    isinstance(name, str) and name.isidentifier() and name[0] != "_" and not hasattr(trainer, name)
                ):
                    name = _free_name(trainer, "lr_scheduler")
                setattr(trainer, name, sched)

    # --- keeping one optimizer's loss to its own parameters ------------------------------------------
    def toggle(self, optimizer: Optimizer, optimizers: Iterable[Optimizer]) -> ToggledOptimizer:
        """Freeze every parameter of `optimizers` that `optimizer` does not also hold (see
        `OptimizationMixin.toggle_optimizer`)."""
        if optimizer in self._toggled:
            self.untoggle(optimizer)
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        frozen: list[torch.Tensor] = []
        for opt in optimizers:
            if opt is optimizer:
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in own and p.requires_grad:
                        p.requires_grad_(False)
                        frozen.append(p)
                        own.add(id(p))  # a parameter shared by two other optimizers: frozen once
        self._toggled[optimizer] = frozen
        return ToggledOptimizer(self, optimizer)

    def untoggle(self, optimizer: Optimizer) -> None:
        """Give back `requires_grad` to the parameters `toggle(optimizer)` froze."""
        for p in self._toggled.pop(optimizer, ()):
            p.requires_grad_(True)


def _bad(owner: str, what: str) -> MisconfigurationError:
    return MisconfigurationError(
        f"{owner}.configure_optimizers returned {what}, which dream_trainer cannot read: {_RETURN_FORMS}."
    )


def _free_name(trainer: object, base: str) -> str:
    """`base`, else `base_1`, `base_2`, ...: the first name the trainer does not use yet."""
    name, i = base, 0
    while hasattr(trainer, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _read(owner: str, returned: Any) -> tuple[list[Optimizer], list[tuple[Any, dict[str, Any]]]]:
    """The optimizers and `(scheduler, its Lightning options)` of a `configure_optimizers` return value."""
    optimizers: list[Optimizer] = []
    schedulers: list[tuple[Any, dict[str, Any]]] = []

    def scheduler_entry(entry: Any) -> None:
        if _is_scheduler(entry):
            schedulers.append((entry, {}))
            return
        if not isinstance(entry, Mapping) or not _is_scheduler(entry.get("scheduler")):
            raise _bad(owner, f"an lr_scheduler that is {type(entry).__qualname__} ({entry!r:.80})")
        unknown = sorted(set(entry) - set(_SCHEDULER_KEYS))
        if unknown:
            raise _bad(owner, f"a scheduler dict with unknown keys {unknown} (known: {list(_SCHEDULER_KEYS)})")
        if entry.get("frequency", 1) != 1:
            raise MisconfigurationError(
                f"{owner}.configure_optimizers: a scheduler with frequency="
                f"{entry['frequency']!r} is not supported (every scheduler steps once per interval). "
                'Write "frequency": 1, or keep the scheduler out of the trainer\'s sight (`self._sched = ...`, '
                "a name starting with `_`) and call its step() yourself every N steps."
            )
        if entry.get("strict", True) is not True:
            raise MisconfigurationError(
                f"{owner}.configure_optimizers: strict=False is not supported: a "
                'ReduceLROnPlateau whose monitored metric is missing always fails. Remove "strict" and '
                'log the monitored metric (or set its "monitor" to one you log).'
            )
        if entry.get("interval", "epoch") not in ("epoch", "step"):
            raise _bad(owner, f'a scheduler dict with "interval": {entry["interval"]!r} (valid: "epoch", "step")')
        schedulers.append((entry["scheduler"], dict(entry)))

    def config_dict(d: Mapping[str, Any]) -> None:
        unknown = sorted(set(d) - {"optimizer", "lr_scheduler", "monitor"})
        if "frequency" in unknown:
            raise MisconfigurationError(
                f'{owner}.configure_optimizers: optimizer dicts with "frequency" (alternating '
                "optimizers) are not supported. Return both optimizers and choose in training_step: "
                "`opt = self.g_optimizer if batch_idx % 2 else self.d_optimizer`, then "
                "self.backward(loss, optimizer=opt) and self.step(opt)."
            )
        if unknown or not isinstance(d.get("optimizer"), Optimizer):
            raise _bad(owner, f'a dict with keys {sorted(d)} (it needs an optimizer under "optimizer")')
        optimizers.append(d["optimizer"])
        if d.get("lr_scheduler") is not None:
            before = len(schedulers)
            scheduler_entry(d["lr_scheduler"])
            if "monitor" in d and "monitor" not in schedulers[before][1]:
                schedulers[before][1]["monitor"] = d["monitor"]

    if isinstance(returned, Optimizer):
        optimizers.append(returned)
    elif isinstance(returned, Mapping):
        config_dict(returned)
    elif isinstance(returned, (list, tuple)):
        items = list(returned)
        if len(items) == 2 and all(isinstance(x, (list, tuple)) for x in items):
            opts, scheds = items  # Lightning's `[optimizers], [schedulers]`
            if not all(isinstance(o, Optimizer) for o in opts):
                raise _bad(owner, "`[optimizers], [schedulers]` whose first list holds something else than optimizers")
            optimizers.extend(opts)
            for entry in scheds:
                scheduler_entry(entry)
        elif items and all(isinstance(x, Optimizer) for x in items):
            optimizers.extend(items)
        elif items and all(isinstance(x, Mapping) for x in items):
            for d in items:
                config_dict(d)
        else:
            kinds = sorted({type(x).__qualname__ for x in items}) or ["nothing"]
            raise _bad(owner, f"a {type(returned).__name__} of {', '.join(kinds)}")
    else:
        raise _bad(owner, f"{type(returned).__qualname__} ({returned!r:.80})")
    return optimizers, schedulers
