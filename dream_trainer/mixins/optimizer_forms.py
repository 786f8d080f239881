"""OptimizerFormsMixin: what a Lightning-style `configure_optimizers` returns, and Lightning's
`optimizers()`, `lr_schedulers()` and `toggle_optimizer()`.

It owns `_scheduler_options` (a returned scheduler dict's `interval`/`monitor`, read by
`OptimizationMixin` when it binds and steps schedulers) and `_toggled` (what `toggle_optimizer` froze).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from dream_trainer.errors import MisconfigurationError
from dream_trainer.mixins.amp import AMPMixin

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
    """What `toggle_optimizer` returns: leaving its `with` block calls `untoggle_optimizer`."""

    def __init__(self, trainer: OptimizerFormsMixin, optimizer: Optimizer) -> None:
        self._trainer = trainer
        self.optimizer = optimizer

    def __enter__(self) -> Optimizer:
        return self.optimizer

    def __exit__(self, *exc: object) -> None:
        self._trainer.untoggle_optimizer(self.optimizer)


class OptimizerFormsMixin(AMPMixin):
    """Reads `configure_optimizers`' return value into attributes discovery finds; `toggle_optimizer`."""

    def _init_optimizer_forms(self) -> None:
        # Per-scheduler `interval`/`monitor` from a returned Lightning scheduler dict, by id(scheduler);
        # schedulers without an entry follow config.scheduler_interval / scheduler_monitor.
        self._scheduler_options: dict[int, tuple[str, str]] = {}
        # The parameters `toggle_optimizer(optimizer)` froze, to unfreeze on `untoggle_optimizer`.
        self._toggled: dict[Optimizer, list[torch.Tensor]] = {}

    # --- Lightning's configure_optimizers return forms -----------------------------------------------
    def _register_returned(self, returned: Any) -> None:
        """Assign what `configure_optimizers` returned (Lightning's forms) to `self`, where discovery finds
        it: optimizers as `optimizer`, `optimizer_1`, ...; schedulers as `lr_scheduler`, `lr_scheduler_1`,
        ... (or a scheduler dict's `"name"`). Objects the method also assigned keep their attribute."""
        if returned is None:
            return
        optimizers: list[Optimizer] = []
        schedulers: list[tuple[Any, dict[str, Any]]] = []  # (scheduler, its Lightning options)

        def bad(what: str) -> MisconfigurationError:
            return MisconfigurationError(
                f"{type(self).__name__}.configure_optimizers returned {what}, which dream_trainer cannot read: "
                f"{_RETURN_FORMS}."
            )

        def scheduler_entry(entry: Any) -> None:
            if _is_scheduler(entry):
                schedulers.append((entry, {}))
                return
            if not isinstance(entry, Mapping) or not _is_scheduler(entry.get("scheduler")):
                raise bad(f"an lr_scheduler that is {type(entry).__qualname__} ({entry!r:.80})")
            unknown = sorted(set(entry) - set(_SCHEDULER_KEYS))
            if unknown:
                raise bad(f"a scheduler dict with unknown keys {unknown} (known: {list(_SCHEDULER_KEYS)})")
            if entry.get("frequency", 1) != 1:
                raise MisconfigurationError(
                    f"{type(self).__name__}.configure_optimizers: a scheduler with frequency="
                    f"{entry['frequency']!r} is not supported (every scheduler steps once per interval). "
                    'Write "frequency": 1, or keep the scheduler out of the trainer\'s sight (`self._sched = ...`, '
                    "a name starting with `_`) and call its step() yourself every N steps."
                )
            if entry.get("strict", True) is not True:
                raise MisconfigurationError(
                    f"{type(self).__name__}.configure_optimizers: strict=False is not supported: a "
                    'ReduceLROnPlateau whose monitored metric is missing always fails. Remove "strict" and '
                    'log the monitored metric (or set its "monitor" to one you log).'
                )
            if entry.get("interval", "epoch") not in ("epoch", "step"):
                raise bad(f'a scheduler dict with "interval": {entry["interval"]!r} (valid: "epoch", "step")')
            schedulers.append((entry["scheduler"], dict(entry)))

        def config_dict(d: Mapping[str, Any]) -> None:
            unknown = sorted(set(d) - {"optimizer", "lr_scheduler", "monitor"})
            if "frequency" in unknown:
                raise MisconfigurationError(
                    f'{type(self).__name__}.configure_optimizers: optimizer dicts with "frequency" (alternating '
                    "optimizers) are not supported. Return both optimizers and choose in training_step: "
                    "`opt = self.g_optimizer if batch_idx % 2 else self.d_optimizer`, then "
                    "self.backward(loss, optimizer=opt) and self.step(opt)."
                )
            if unknown or not isinstance(d.get("optimizer"), Optimizer):
                raise bad(f'a dict with keys {sorted(d)} (it needs an optimizer under "optimizer")')
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
                    raise bad("`[optimizers], [schedulers]` whose first list holds something else than optimizers")
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
                raise bad(f"a {type(returned).__name__} of {', '.join(kinds)}")
        else:
            raise bad(f"{type(returned).__qualname__} ({returned!r:.80})")

        known_opts = {id(o) for _, o in self.named_optimizers()}
        for opt in optimizers:
            if id(opt) not in known_opts:
                setattr(self, self._free_name("optimizer"), opt)
        known_scheds = {id(s) for _, s in self.named_schedulers()}
        returned_opts = {id(o) for o in optimizers} | known_opts
        interval, monitor = self.config.scheduler_interval, self.config.scheduler_monitor
        for sched, options in schedulers:
            if id(sched.optimizer) not in returned_opts:
                raise bad("a scheduler whose optimizer is neither returned nor assigned to the trainer")
            if options:
                self._scheduler_options[id(sched)] = (
                    options.get("interval", interval),
                    options.get("monitor", monitor),
                )
            if id(sched) not in known_scheds:
                name = options.get("name")
                if not (isinstance(name, str) and name.isidentifier() and name[0] != "_" and not hasattr(self, name)):
                    name = self._free_name("lr_scheduler")
                setattr(self, name, sched)

    def _free_name(self, base: str) -> str:
        """`base`, else `base_1`, `base_2`, ...: the first name the trainer does not use yet."""
        name, i = base, 0
        while hasattr(self, name):
            i += 1
            name = f"{base}_{i}"
        return name

    def scheduler_interval(self, scheduler: Any) -> str:
        """When `scheduler` steps: `"step"` (after each optimizer step) or `"epoch"` (at each epoch's end).
        Its `"interval"` when `configure_optimizers` returned it in a dict, else `config.scheduler_interval`."""
        options = self._scheduler_options.get(id(scheduler))
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

    # --- keeping one optimizer's loss to its own parameters ---------------------------------------------
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
        if optimizer in self._toggled:
            self.untoggle_optimizer(optimizer)
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        frozen: list[torch.Tensor] = []
        for opt in self._all_optimizers():
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

    toggled_optimizer = toggle_optimizer  # Lightning 2.5's name for the context-manager form

    def untoggle_optimizer(self, optimizer: Optimizer) -> None:
        """Give back `requires_grad` to the parameters `toggle_optimizer(optimizer)` froze."""
        for p in self._toggled.pop(optimizer, ()):
            p.requires_grad_(True)

    def _all_optimizers(self) -> tuple[Optimizer, ...]:
        bound: tuple[Optimizer, ...] | None = getattr(self, "_optimizer_list", None)
        return bound if bound is not None else tuple(o for _, o in self.named_optimizers())
