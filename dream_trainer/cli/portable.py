"""What `--print_config` prints: the parsed config, written so that `dream-trainer COMMAND --config
printed.yaml` runs it as it is from any working directory, wherever the file is.

The trainer is named as `loading.printed_target` says (a trainer file by its absolute path). Every value
that is a path relative to the working directory is made absolute: `root_dir`, `resume_from` and
`ckpt_path` (`last` stays `last`); every config field and `__init__` parameter annotated `pathlib.Path`
or `os.PathLike`; and, in each `{type: Name, ...}` entry (`callbacks`, `loggers`, an `__init__`
parameter's configs), every argument that the class's `__init__` annotates so (`CSVLogger(save_dir=...)`).
Other strings are printed as they are: a `str` that holds a path cannot be told from a name.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
import typing
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Union

from jsonargparse import Namespace

from dream_trainer.cli.loading import config_class_of, init_params
from dream_trainer.registry import CALLBACKS, LOGGERS, Registry, _resolve
from dream_trainer.trainer import DreamTrainer

PATH_KEYS = ("root_dir", "resume_from", "ckpt_path")  # str-typed paths of DreamTrainerConfig and the CLI
_LAST = ("resume_from", "ckpt_path")  # where "last" is a keyword, not a path
_LISTED: dict[str, Registry[Any]] = {"callbacks": CALLBACKS, "loggers": LOGGERS}


def portable_config(cfg: Namespace, trainer_cls: type[DreamTrainer], trainer: str | None) -> Namespace:
    """A copy of the parsed `cfg` to print: `trainer` (from `printed_target`) as its trainer, and each
    relative path made absolute against the working directory (see the module's docstring)."""
    cfg = cfg.clone()
    if trainer is not None:
        cfg["trainer"] = trainer
    params = init_params(trainer_cls)
    keys = [*PATH_KEYS, *(name for name, tp in _hints(config_class_of(trainer_cls)).items() if _is_path_type(tp))]
    keys += [p.name for p in params if _is_path_type(p.annotation)]
    for key in dict.fromkeys(keys):
        if key in cfg:
            cfg[key] = absolute(cfg[key], keep_last=key in _LAST)
    for key, registry in _LISTED.items():
        if key in cfg:
            cfg[key] = _entries(cfg[key], (registry,))
    for p in params:
        if p.name in cfg and p.name not in keys:
            cfg[p.name] = _entries(cfg[p.name], ())
    return cfg


def absolute(value: Any, keep_last: bool = False) -> Any:
    """`value` made absolute against the working directory when it is a relative path; anything else
    (None, an absolute path, `"last"` when `keep_last`, a value that is no path) as it is."""
    if not isinstance(value, (str, os.PathLike)) or (keep_last and value == "last"):
        return value
    path = os.fspath(value)
    if not isinstance(path, str) or os.path.isabs(path):
        return value
    return type(value)(os.path.abspath(path)) if isinstance(value, PurePath) else os.path.abspath(path)


def _entries(value: Any, first: tuple[Registry[Any], ...]) -> Any:
    """`value` with the path arguments of every `{type: Name, ...}` mapping in it (itself included, and in
    lists and mappings) made absolute. `Name` is looked up as building it does: in `first`, then in every
    registry, then as a dotted path; one that cannot be found is left as it is (the run reports it)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_entries(v, first) for v in value)
    if not isinstance(value, Mapping):
        return value
    out = {k: _entries(v, first) for k, v in value.items()}
    if "type" in out:
        args, type_ = out, out["type"]
    elif "class_path" in out and isinstance(out.get("init_args"), Mapping):  # jsonargparse's form
        args = out["init_args"] = dict(out["init_args"])
        type_ = out["class_path"]
    else:
        return out
    try:
        target = _resolve(type_, first)
    except Exception:
        return out
    hints = _hints(target)
    for name, arg in args.items():
        if name != "type" and _is_path_type(hints.get(name)):
            args[name] = absolute(arg)
    return out


def _hints(obj: Any) -> dict[str, Any]:
    """The annotations of a dataclass's fields, or of a class's (or function's) parameters."""
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        where: Any = obj
    elif inspect.isclass(obj):
        where = obj.__init__
    else:
        where = obj
    try:
        return typing.get_type_hints(where)
    except Exception:  # an annotation that does not evaluate: no path found there
        return {}


def _is_path_type(tp: Any) -> bool:
    """`pathlib.Path` (any `PurePath`), `os.PathLike[str]`, or a union holding one (`str | os.PathLike | None`)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_is_path_type(a) for a in typing.get_args(tp))
    tp = typing.get_origin(tp) or tp
    return inspect.isclass(tp) and issubclass(tp, (os.PathLike, PurePath))
