"""Finding what the command line names: the trainer class (`file.py:Class`, `pkg.module:Class`, a
`TRAINERS` name), its config class, and the extra `__init__` parameters it accepts."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
import types
import typing
from collections import abc
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union

from dream_trainer.config import DreamTrainerConfig
from dream_trainer.errors import DreamTrainerError
from dream_trainer.registry import TRAINERS, RegistryError, locate
from dream_trainer.trainer import DreamTrainer


class CLIError(DreamTrainerError):
    """A usage error: the command line or config names something that does not exist or fit."""


_LOADED: dict[Path, types.ModuleType] = {}


def load_trainer_class(target: str, search_dirs: tuple[Path, ...] = ()) -> type[DreamTrainer]:
    """The DreamTrainer subclass `target` names.

    `path/to/file.py:Class` (or just `file.py` when it defines exactly one trainer), `pkg.module:Class`,
    `pkg.module.Class`, or a name registered in `TRAINERS`. A relative file path is looked up in
    `search_dirs` (the directory of the config file that named it), then in the working directory.
    """
    file_part, cls_name = _split_target(target)
    if _is_file(file_part):
        module = _load_file(file_part, search_dirs)
        return _pick_trainer(module, cls_name, target)
    if cls_name:
        try:
            module = importlib.import_module(file_part)
        except (ImportError, SyntaxError) as exc:
            raise CLIError(f"trainer {target!r}: cannot import module {file_part!r}: {_import_failure(exc)}") from exc
        return _pick_trainer(module, cls_name, target)
    if target in TRAINERS:
        return _check_trainer(TRAINERS.get(target), target)
    if "." in target:
        try:
            return _check_trainer(locate(target), target)
        except (RegistryError, ImportError) as exc:
            raise CLIError(f"trainer {target!r}: {exc}") from exc
    raise CLIError(
        f"trainer {target!r} not found: give path/to/file.py:ClassName, package.module:ClassName, or a name "
        f"registered in TRAINERS ({', '.join(TRAINERS.list()) or 'none registered'})"
    )


def printed_target(target: str, trainer_cls: type[DreamTrainer], search_dirs: tuple[Path, ...] = ()) -> str:
    """`target` (which loaded `trainer_cls`) as `--print_config` writes it: a name that loads the same class
    from any working directory, wherever the printed file is.

    A trainer file is named by its absolute path, `/abs/path/file.py:Class`. A module (`pkg.module:Class`,
    `pkg.module.Class`) or a `TRAINERS` name is kept as given: it imports wherever its package does
    (installed, or on PYTHONPATH). A top-level module that imports only from the working directory
    (`python -m dream_trainer.cli fit my_trainer:MyTrainer`, which puts the directory on sys.path) is named
    by its file's absolute path too, which imports it the same way.
    """
    file_part, cls_name = _split_target(target)
    if _is_file(file_part):
        return f"{_find_file(file_part, search_dirs)}:{cls_name or trainer_cls.__name__}"
    if cls_name:
        module_name, attr = file_part, cls_name
    elif target in TRAINERS:
        return target
    else:
        module_name, _, attr = target.rpartition(".")
    if "." in module_name or _importable_elsewhere(module_name):
        return target
    file = getattr(sys.modules.get(module_name), "__file__", None)
    if file and getattr(sys.modules[module_name], attr, None) is trainer_cls:
        return f"{Path(file).resolve()}:{attr}"
    return target


def _importable_elsewhere(top: str) -> bool:
    """Whether the top-level module or package `top` is found without the working directory on sys.path."""
    if top in sys.builtin_module_names:
        return True
    cwd = Path.cwd().resolve()
    paths = [p for p in sys.path if os.path.isabs(p) and Path(p).resolve() != cwd]
    for finder in sys.meta_path:
        try:
            if finder is importlib.machinery.PathFinder:
                spec = importlib.machinery.PathFinder.find_spec(top, paths)
            else:
                find_spec = getattr(finder, "find_spec", None)
                spec = find_spec(top, None) if find_spec is not None else None
        except Exception:  # a finder that cannot say: not found through it
            spec = None
        if spec is not None:
            return True
    return False


def _split_target(target: str) -> tuple[str, str]:
    """`(file or module, class name)`: `("a/b.py", "C")` for `a/b.py:C`; `("a/b.py", "")` for `a/b.py`."""
    file_part, sep, cls_name = target.rpartition(":")
    if not sep or "/" in cls_name or "\\" in cls_name:  # no class given ("C:\x.py" is a path, too)
        return target, ""
    return file_part, cls_name


def _is_file(file_part: str) -> bool:
    return file_part.endswith(".py") or os.sep in file_part or "/" in file_part


def _find_file(file_part: str, search_dirs: tuple[Path, ...]) -> Path:
    """The absolute path of the trainer file `file_part`: relative, it is looked up in each of `search_dirs`,
    then in the working directory."""
    candidates = [d / file_part for d in search_dirs if not Path(file_part).is_absolute()] + [Path(file_part)]
    candidates = list(dict.fromkeys(candidates))  # a config file in the working directory: looked in once
    path = next((p.resolve() for p in candidates if p.is_file()), None)
    if path is None:
        raise CLIError(f"trainer file {file_part!r} not found (looked in {', '.join(str(c) for c in candidates)})")
    return path


def _load_file(file_part: str, search_dirs: tuple[Path, ...]) -> types.ModuleType:
    path = _find_file(file_part, search_dirs)
    if path in _LOADED:
        return _LOADED[path]
    main_module = sys.modules.get("__main__")
    main_file = getattr(main_module, "__file__", None)
    if main_module is not None and main_file and Path(main_file).resolve() == path:
        return main_module  # `python file.py` whose __main__ block calls the CLI: don't run it twice
    # Import the file as a script runs: its directory on sys.path (sibling imports and DataLoader
    # worker processes find it), under its own name when that is free.
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    name = path.stem
    if not name.isidentifier() or name in sys.modules:
        name = f"_dream_trainer_cli_{name}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as exc:  # the file cannot be imported as it is: say where, in one line
        del sys.modules[name]
        raise CLIError(f"cannot import trainer file {str(path)!r}: {_import_failure(exc)}") from exc
    except BaseException:  # anything else the file's top-level code raises is a bug there: its traceback
        del sys.modules[name]
        raise
    _LOADED[path] = module
    return module


def _import_failure(exc: ImportError | SyntaxError) -> str:
    """What went wrong importing a trainer's module, and where: `No module named 'x' (file.py, line 3)`."""
    if isinstance(exc, SyntaxError):
        where = f" ({Path(exc.filename).name}, line {exc.lineno})" if exc.filename else ""
        return f"{type(exc).__name__}: {exc.msg}{where}"
    # The innermost frame of the user's source: the import statement that failed (not importlib's, not ours).
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_source(f.filename)]
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    hint = "; install it, or put its directory on PYTHONPATH" if isinstance(exc, ModuleNotFoundError) else ""
    return f"{exc}{where}{hint}"


def _is_user_source(filename: str) -> bool:
    return not filename.startswith("<") and "importlib" not in Path(filename).parts and filename != __file__


def _trainers_in(module: types.ModuleType) -> list[str]:
    return sorted(
        n
        for n, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, DreamTrainer) and obj is not DreamTrainer
    )


def _pick_trainer(module: types.ModuleType, cls_name: str, target: str) -> type[DreamTrainer]:
    found = _trainers_in(module)
    where = getattr(module, "__file__", None) or module.__name__
    if not cls_name:
        own = [n for n in found if getattr(module, n).__module__ == module.__name__]
        if len(own) == 1:
            return getattr(module, own[0])
        raise CLIError(
            f"{where} defines {len(own)} DreamTrainer subclasses ({', '.join(own) or 'none'}); "
            f"name one: {target}:ClassName"
        )
    if cls_name not in vars(module):
        close = difflib.get_close_matches(cls_name, found, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise CLIError(
            f"{where} has no class {cls_name!r}.{hint} DreamTrainer subclasses found there: "
            f"{', '.join(found) or 'none'}"
        )
    return _check_trainer(getattr(module, cls_name), target, found)


def _check_trainer(obj: Any, target: str, found: list[str] | None = None) -> type[DreamTrainer]:
    if inspect.isclass(obj) and issubclass(obj, DreamTrainer):
        return obj
    tail = f" DreamTrainer subclasses found there: {', '.join(found) or 'none'}" if found is not None else ""
    raise CLIError(f"trainer {target!r} is {obj!r}, not a DreamTrainer subclass.{tail}")


# --- the config class --------------------------------------------------------------------------------
def config_class_of(trainer_cls: type[DreamTrainer]) -> type[DreamTrainerConfig]:
    """The config dataclass `trainer_cls` takes: its `config_class` attribute, else the most specific of
    the `config` annotations of `__init__` and of the class body (`config: MyConfig`)."""
    explicit = getattr(trainer_cls, "config_class", None)
    if explicit is not None:
        if not (inspect.isclass(explicit) and issubclass(explicit, DreamTrainerConfig)):
            raise CLIError(f"{trainer_cls.__name__}.config_class = {explicit!r} is not a DreamTrainerConfig subclass")
        return explicit
    candidates: list[Any] = []
    init = trainer_cls.__init__
    param = inspect.signature(init).parameters.get("config")
    if param is not None:
        candidates.append(_evaluate(param.annotation, getattr(init, "__globals__", {})))
    for klass in trainer_cls.__mro__:
        ann = inspect.get_annotations(klass).get("config")
        if ann is not None:
            module = sys.modules.get(klass.__module__)
            candidates.append(_evaluate(ann, vars(module) if module else {}))
    best: type[DreamTrainerConfig] = DreamTrainerConfig
    for cand in candidates:
        for tp in typing.get_args(cand) or (cand,):  # MyConfig | None
            if inspect.isclass(tp) and issubclass(tp, best):
                best = tp
    if not dataclasses.is_dataclass(best):
        raise CLIError(f"{best.__qualname__} (the config of {trainer_cls.__name__}) must be a @dataclass")
    return best


def _evaluate(annotation: Any, namespace: Mapping[str, Any]) -> Any:
    if isinstance(annotation, str):
        try:
            return eval(annotation, dict(namespace))
        except Exception:
            return None
    return annotation


# --- extra __init__ parameters -----------------------------------------------------------------------
@dataclasses.dataclass
class InitParam:
    """One `__init__` parameter besides `config`, as the CLI offers it."""

    name: str
    cli_type: Any  # the type jsonargparse checks values against
    default: Any  # inspect.Parameter.empty: required
    build: bool  # a {"type": ...} value is built through the registries before the call
    annotation: Any


def init_params(trainer_cls: type[DreamTrainer]) -> list[InitParam]:
    """The parameters of `trainer_cls.__init__` other than `config`.

    Plain-data annotations (int, str, list[float], dict[str, Any], Literal, ...) are kept, and such
    values are passed as they are: a `dict` parameter receives the raw config (build it later, e.g.
    after the model exists). Any other annotation (`nn.Module`, ...) or none becomes `Any`, and a
    `{"type": ...}` value (or a name, for a class-typed parameter) is built through the registries.
    """
    init = trainer_cls.__init__
    try:
        hints = typing.get_type_hints(init)
    except Exception:
        hints = {}
    out = []
    for p in list(inspect.signature(init).parameters.values())[1:]:  # skip self
        if p.name == "config" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        ann = hints.get(p.name, _evaluate(p.annotation, getattr(init, "__globals__", {})))
        plain = ann is not inspect.Parameter.empty and ann is not None and _is_plain(ann)
        out.append(InitParam(p.name, ann if plain else Any, p.default, build=not plain, annotation=ann))
    return out


_PLAIN_TYPES = (int, float, str, bool, type(None), Path, list, tuple, dict, set)
_CONTAINERS = (list, tuple, dict, set, frozenset, abc.Sequence, abc.Mapping, abc.MutableMapping)


def _is_plain(tp: Any) -> bool:
    if tp is Any or tp in _PLAIN_TYPES:
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return True
    if origin is Union or origin is types.UnionType:
        return all(_is_plain(a) for a in typing.get_args(tp))
    if origin in _CONTAINERS:
        return all(a is Ellipsis or _is_plain(a) for a in typing.get_args(tp))
    return False


def is_plain_value(value: Any) -> bool:
    """A default jsonargparse can show and dump (None, numbers, strings, lists/dicts of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_value(v) for k, v in value.items())
    return False
