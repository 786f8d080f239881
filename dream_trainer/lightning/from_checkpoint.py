"""`Trainer.load_from_checkpoint(path, **overrides)`: a trainer rebuilt from a checkpoint's own record.

Every checkpoint records its config as plain data (`config.to_dict()`, under `state["dream_trainer"]`;
for a sharded checkpoint in its `trainer_state.pt`), read with `torch.load(weights_only=True)`, so
rebuilding never unpickles an object. The config class is the trainer class's own (its `config_class`
attribute, else the `config` annotation of its `__init__`), never a name taken from the file.

What is restored: the config (with `overrides`), then the models' weights. Optimizers, schedulers,
counters and RNG start fresh, as after Lightning's `load_from_checkpoint`: `fit()` then trains a new
run from these weights, and `fit(ckpt_path=path)` resumes the whole training state instead.

Lightning's classmethod; `CheckpointMixin.load_from_checkpoint` calls `build_from_checkpoint` (the
seam), nothing else uses this module. It builds the trainer and reads the checkpoint's record; loading
the weights into the trainer is the trainer's own work (`CheckpointMixin`), so nothing here reaches
inside a trainer.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import typing
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

from dream_trainer.config import DreamTrainerConfig
from dream_trainer.errors import CheckpointError, ConfigError
from dream_trainer.utils.checkpoint_io import TRAINER_STATE, find_last, is_sharded_checkpoint, read_checkpoint
from dream_trainer.utils.run_dirs import CHECKPOINTS, runs_newest_first

T = TypeVar("T")


class Rebuilt(NamedTuple, Generic[T]):
    """A trainer built from a checkpoint's config, and the checkpoint its weights are to be loaded from."""

    trainer: T
    path: Path
    state: dict[str, Any]  # the checkpoint's plain record (a sharded one's `trainer_state.pt`)


# Live objects, recorded by class name only: not rebuilt (pass them again as overrides).
_LIVE_FIELDS = ("callbacks", "loggers")


def build_from_checkpoint(cls: type[T], path: str | os.PathLike[str], overrides: dict[str, Any]) -> Rebuilt[T]:
    """`cls(config, **init_kwargs)` with the config recorded in the checkpoint at `path` (with the
    config fields among `overrides` replaced), the checkpoint resolved (`"last"`) and its record read;
    the caller loads the weights."""
    config_cls = config_class_of(cls)
    init_names = _init_params(cls)
    field_names = [f.name for f in dataclasses.fields(config_cls) if f.init]
    config_overrides = {k: v for k, v in overrides.items() if k in field_names}
    init_kwargs = {k: v for k, v in overrides.items() if k not in field_names}
    unknown = [k for k in init_kwargs if k not in init_names]
    if unknown:
        raise ConfigError(_unknown_message(cls, config_cls, unknown[0], field_names, init_names))
    if os.fspath(path) == "last":
        path = _newest_checkpoint(config_cls, config_overrides)
    ckpt = Path(path)
    state = _read_record(ckpt)
    config = _config_from_record(config_cls, state, ckpt, config_overrides)
    missing = [n for n, p in init_names.items() if p.default is inspect.Parameter.empty and n not in init_kwargs]
    if missing:
        raise ConfigError(
            f"{cls.__name__}.__init__ needs {', '.join(missing)} besides the config, and checkpoints record only "
            f"the config: pass {'them' if len(missing) > 1 else 'it'} again, "
            f"{cls.__name__}.load_from_checkpoint({str(ckpt)!r}, {missing[0]}=...), or make "
            f"{'them' if len(missing) > 1 else 'it'} a field of the config, which checkpoints record"
        )
    factory: Any = cls
    return Rebuilt(typing.cast(T, factory(config, **init_kwargs)), ckpt, state)


def config_class_of(trainer_cls: type) -> type[DreamTrainerConfig]:
    """The config dataclass `trainer_cls` takes: its `config_class` attribute, else the most specific
    `DreamTrainerConfig` subclass in the `config` annotation of its `__init__` (default: the base)."""
    explicit = getattr(trainer_cls, "config_class", None)
    if explicit is not None:
        if not (inspect.isclass(explicit) and issubclass(explicit, DreamTrainerConfig)):
            raise ConfigError(
                f"{trainer_cls.__name__}.config_class = {explicit!r} is not a DreamTrainerConfig subclass"
            )
        return explicit
    try:
        annotation = typing.get_type_hints(vars_init(trainer_cls)).get("config")
    except Exception:  # an annotation that does not evaluate: fall back to the base class
        annotation = None
    best: type[DreamTrainerConfig] = DreamTrainerConfig
    for tp in typing.get_args(annotation) or (annotation,):  # MyConfig | None
        if inspect.isclass(tp) and issubclass(tp, best):
            best = tp
    return best


def vars_init(cls: type) -> Any:
    """`cls.__init__`, looked up on the class (as Python calls it)."""
    return getattr(cls, "__init__")  # noqa: B009 - mypy refuses `cls.__init__` on a `type`


def _init_params(cls: type) -> dict[str, inspect.Parameter]:
    """`__init__`'s keyword-passable parameters other than `config`."""
    params = list(inspect.signature(vars_init(cls)).parameters.values())[1:]  # skip self
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p for p in params if p.name != "config" and p.kind in kinds}


def _unknown_message(cls: type, config_cls: type, name: str, field_names: list[str], init_names: dict[str, Any]) -> str:
    choices = [*field_names, *init_names]
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    extra = f" or a parameter of {cls.__name__}.__init__ ({', '.join(init_names)})" if init_names else ""
    return (
        f"{cls.__name__}.load_from_checkpoint({name}=...): {name!r} is neither a field of "
        f"{config_cls.__name__}{extra}.{hint}"
    )


def _newest_checkpoint(config_cls: type[DreamTrainerConfig], overrides: dict[str, Any]) -> Path:
    """`"last"`: the newest valid checkpoint of the newest run under `root_dir` (of `run_name`)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls) if f.default is not dataclasses.MISSING}
    root = Path(overrides.get("root_dir", defaults.get("root_dir", "runs")))
    run_name = overrides.get("run_name", defaults.get("run_name"))
    for run in runs_newest_first(root, run_name):
        found = find_last(run / CHECKPOINTS)
        if found is not None:
            return found[0]
    family = f" named {run_name!r}" if run_name else ""
    raise CheckpointError(
        f'load_from_checkpoint("last"): no run{family} under {str(root)!r} has a valid checkpoint; '
        "pass a checkpoint path, or root_dir=/run_name= to look elsewhere"
    )


def _read_record(path: Path) -> dict[str, Any]:
    """The checkpoint's plain state (`torch.load(weights_only=True)`): the file itself, or a sharded
    directory's `trainer_state.pt` (its models stay in the DCP shards)."""
    if is_sharded_checkpoint(path):
        return read_checkpoint(path / TRAINER_STATE)
    if path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a directory but not a complete sharded checkpoint (it has no .metadata and "
            f"{TRAINER_STATE}): pass a checkpoint file or a finished sharded checkpoint directory"
        )
    return read_checkpoint(path)


def _config_from_record(
    config_cls: type[DreamTrainerConfig], state: dict[str, Any], path: Path, overrides: dict[str, Any]
) -> DreamTrainerConfig:
    record = (state.get("dream_trainer") or {}).get("config")
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{str(path)!r} records no config (state['dream_trainer']['config']): it was not written by "
            "save_checkpoint; build the trainer yourself and call load_checkpoint(path)"
        )
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    foreign = sorted(set(record) - set(fields))
    if foreign:
        raise CheckpointError(
            f"the config recorded in {str(path)!r} has fields {foreign} that {config_cls.__name__} lacks: it was "
            f"written with another config class. Name it on the trainer (config_class = MyConfig, or annotate "
            "__init__(self, config: MyConfig))"
        )
    values = {k: v for k, v in record.items() if k not in _LIVE_FIELDS}
    # Recorded by class name only: live objects are not rebuilt from a file (pass them again).
    values["callbacks"] = []
    values["loggers"] = None if record.get("loggers") is None else []
    # The loaded trainer starts from these weights; resuming the whole run is fit(ckpt_path=...).
    values["resume_from"] = None
    values.update(overrides)
    try:
        return config_cls(**values)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc} (the config recorded in {str(path)!r}; replace a field with "
            "load_from_checkpoint(path, field=value))"
        ) from exc
