"""The `dream-trainer` command: config-driven `fit`, `validate` and `test` runs of a DreamTrainer subclass.

```
dream-trainer fit path/to/file.py:MyTrainer --config cfg.yaml --n_epochs 3 [--ckpt_path last|PATH]
dream-trainer validate path/to/file.py:MyTrainer --config cfg.yaml --ckpt_path last
dream-trainer fit path/to/file.py:MyTrainer --help           # every config field, with its docstring
dream-trainer fit path/to/file.py:MyTrainer --config cfg.yaml --print_config   # the resolved YAML, runnable anywhere
```

Every field of the trainer's config dataclass is a flag and a top-level YAML key; later sources win,
so `--config cfg.yaml --n_epochs 3` overrides the file. `callbacks` and `loggers` are lists of
`{type: Name, ...}` entries (or bare names) built through `CALLBACKS` / `LOGGERS`. The trainer's other
`__init__` parameters are flags/keys too: plain-data ones (numbers, strings, `dict`, ...) are passed as
given, others (`model: nn.Module`) are built from their `{type: ...}` config through the registries.
Parsing, `--help` and YAML are jsonargparse's. An error is one line on stderr: exit status 2 for a usage
or config error, 1 for a run that cannot go on (see `dream_trainer.cli.reporting`); `dream-trainer --debug
COMMAND ...` prints the traceback too.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
import sys
from argparse import ArgumentError
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace

from dream_trainer.cli.config_file import config_arguments, read_config_file
from dream_trainer.cli.loading import CLIError, InitParam, config_class_of, init_params, is_plain_value, printed_target
from dream_trainer.cli.loading import load_trainer_class as load_trainer_class
from dream_trainer.cli.names import check_config_keys, unknown_flags_message
from dream_trainer.cli.portable import portable_config
from dream_trainer.cli.preflight import check_ckpt_path, check_step, evaluated_checkpoint, resolve_last
from dream_trainer.cli.reporting import DEBUG_FLAG, exit_status, one_line, report, split_debug
from dream_trainer.errors import ConfigError
from dream_trainer.registry import CALLBACKS, LOGGERS, Registry, RegistryError, build_nested
from dream_trainer.trainer import DreamTrainer

__all__ = ["CLIError", "CLIResult", "build_parser", "main", "run"]

PROG = "dream-trainer"
COMMANDS = {
    "fit": "Train: trainer.fit(ckpt_path). --ckpt_path last|PATH resumes.",
    "validate": "Run validation alone, trainer.validate(ckpt_path=...), and print its metrics as JSON.",
    "test": "Run the test loop, trainer.test(ckpt_path=...), and print its metrics as JSON.",
}
TOOLS = {"runs": "List the runs under a root_dir: status, last step, newest checkpoint, how each ended."}
_RESERVED = {"trainer", "config", "ckpt_path", "print_config", "help"}
_LISTED = {"callbacks": CALLBACKS, "loggers": LOGGERS}  # config fields built from {type: ...} entries
_EMPTY = inspect.Parameter.empty
_ENTRY = list[str | dict[str, Any]] | None


class CLIResult(NamedTuple):
    """What `run` did: the trainer (after the command) and, for validate/test, the metrics."""

    command: str
    trainer: DreamTrainer
    metrics: dict[str, float] | None


# --- entry points ------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """The `dream-trainer` console script. Returns the exit status: 0 done (or `--help`), 2 a usage or
    config error, 1 a run dream_trainer cannot go on with; either is one line on stderr naming what to
    change (`--debug` before the command: the traceback too). Any other exception, from the trainer's
    own code, propagates with its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, argv = split_debug(argv)
    try:
        run(argv)
    except SystemExit as exc:  # --help and --print_config: already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        status = exit_status(exc)
        if status is None:
            raise  # the trainer's code (or a bug in dream_trainer): the traceback is what finds it
        command = argv[0] if argv and (argv[0] in COMMANDS or argv[0] in TOOLS) else None
        report(exc, f"{PROG}{' ' + command if command else ''}", debug)
        return status
    return 0


def run(argv: Sequence[str]) -> CLIResult:
    """Parse `argv` (without the program name), build config and trainer, run the command.

    Raises `CLIError`/`ConfigError`/`RegistryError` for usage and config errors, another
    `DreamTrainerError` when the run cannot go on (no `test_step` for `test`, no checkpoint, ...), and
    `SystemExit` for `--help` and `--print_config` (after printing them), as `main` expects. A leading
    `--debug` is ignored (`main` reads it).
    """
    _, argv = split_debug(list(argv))
    if argv and argv[0] == "runs":  # needs no trainer: prints its table, then exits like --help
        from dream_trainer.cli.runs import runs_command

        raise SystemExit(runs_command(argv[1:]))
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            _top_parser().print_help()
            raise SystemExit(0)
        raise CLIError(_no_command(argv))
    command, rest = argv[0], argv[1:]
    target, search_dirs, rest = _find_target(rest)
    if target is None:
        if any(a in ("-h", "--help") for a in rest):
            _command_parser(command).print_help()
            raise SystemExit(0)
        raise CLIError(
            f"which trainer? {PROG} {command} path/to/file.py:MyTrainer [--config cfg.yaml] [--FIELD VALUE ...] "
            "(or put 'trainer: path/to/file.py:MyTrainer' in the config file)"
        )
    trainer_cls = load_trainer_class(target, search_dirs)
    parser = build_parser(command, trainer_cls, printed_target(target, trainer_cls, search_dirs))
    ns = _parse(parser, rest)
    check_step(command, trainer_cls)
    ckpt_path = ns.get("ckpt_path")
    check_ckpt_path(ckpt_path)
    trainer = instantiate(trainer_cls, ns)
    if command == "fit":
        trainer.fit(ckpt_path=ckpt_path)  # "last" with nothing to resume: a warning, and a new run
        return CLIResult(command, trainer, None)
    if ckpt_path == "last":
        ckpt_path = resolve_last(command, trainer)
    method = getattr(trainer, command, None)
    if method is None:
        raise CLIError(f"{trainer_cls.__name__} has no {command}() method")
    metrics = method(ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        # Which checkpoint "last" was, on stderr (stdout is the metrics' JSON line); a checkpoint that
        # fails to load is named by the error instead.
        print(f"{PROG} {command}: {evaluated_checkpoint(ckpt_path)}", file=sys.stderr, flush=True)
        print(json.dumps({k: float(v) for k, v in metrics.items()}), flush=True)
    return CLIResult(command, trainer, metrics)


def _no_command(argv: list[str]) -> str:
    """The error for a command line that does not start with a command."""
    usage = f"{PROG} [{DEBUG_FLAG}] {{{','.join(COMMANDS)}}} TRAINER [--config CFG.yaml] [--FIELD VALUE ...]"
    if not argv:
        return f"no command given: {usage} ({PROG} --help lists the commands)"
    first = argv[0]
    close = difflib.get_close_matches(first, [*COMMANDS, *TOOLS], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    what = "option" if first.startswith("-") else "command"
    return f"invalid choice of {what} {first!r}{hint}: {usage}"


# --- parsers -----------------------------------------------------------------------------------------
def _top_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=PROG,
        description="Config-driven dream_trainer runs. "
        f"Run '{PROG} COMMAND path/to/file.py:MyTrainer --help' to list that trainer's flags.",
    )
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        help="Before the command: on an error, print its full traceback, not only its one-line message.",
    )
    sub = parser.add_subcommands(dest="command")
    for name in COMMANDS:
        sub.add_subcommand(name, _command_parser(name), help=COMMANDS[name])
    from dream_trainer.cli.runs import runs_parser

    sub.add_subcommand("runs", runs_parser(), help=TOOLS["runs"])
    return parser


class _Parser(ArgumentParser):
    """jsonargparse's parser, whose `dump` (what `--print_config` prints) is of `portable_config(values)`:
    the trainer named so that it loads from any directory, relative paths made absolute."""

    printed_as: tuple[type[DreamTrainer], str | None] | None = None  # (trainer class, trainer to print)

    def dump(self, cfg: Namespace, *args: Any, **kwargs: Any) -> str:
        if self.printed_as is not None:
            cfg = portable_config(cfg, *self.printed_as)
        return super().dump(cfg, *args, **kwargs)


def _command_parser(command: str) -> _Parser:
    parser = _Parser(
        prog=f"{PROG} {command}",
        usage=f"{PROG} {command} TRAINER [--config CFG.yaml] [--FIELD VALUE ...] [--ckpt_path last|PATH]",
        description=COMMANDS[command]
        + " TRAINER is path/to/file.py:ClassName, package.module:ClassName or a name registered in "
        "dream_trainer.registry.TRAINERS; with TRAINER given, --help lists its config fields.",
        exit_on_error=False,
        allow_abbrev=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML config file; flags after it override it.")
    parser.add_argument(
        "--trainer",
        type=str | None,
        default=None,
        help="The trainer (also the first positional argument, or 'trainer:' in the config file).",
    )
    what = "resume from" if command == "fit" else "load first"
    parser.add_argument(
        "--ckpt_path",
        type=str | None,
        default=None,
        help=f"Checkpoint to {what}: a path, or 'last' (the newest checkpoint of the newest run under "
        "<root_dir>, of --run_name when given"
        + (
            ", which then continues in its own directory). Default: the config's resume_from."
            if command == "fit"
            else "). Default: the current weights."
        ),
    )
    return parser


def build_parser(command: str, trainer_cls: type[DreamTrainer], printed_trainer: str | None = None) -> ArgumentParser:
    """The parser of `dream-trainer COMMAND`: base flags, the config's fields, the extra `__init__` args.

    Its `--print_config` prints a config that runs back as it is from any directory: the trainer as
    `printed_trainer` (`dream_trainer.cli.loading.printed_target`; None: as given), relative paths made
    absolute (`dream_trainer.cli.portable`)."""
    _enable_field_docs()
    parser = _command_parser(command)
    parser.printed_as = (trainer_cls, printed_trainer)
    config_cls = config_class_of(trainer_cls)
    fields = [f for f in dataclasses.fields(config_cls) if f.init]
    names = {f.name for f in fields}
    parser.add_class_arguments(
        config_cls,
        nested_key=None,
        skip=set(_LISTED),
        instantiate=False,
        fail_untyped=False,
        help=f"{config_cls.__name__} fields (the config of {trainer_cls.__name__})",
    )
    group = parser.add_argument_group("callbacks and loggers, built through dream_trainer.registry")
    for name, registry in _LISTED.items():
        if name in names:
            group.add_argument(
                f"--{name}",
                type=_ENTRY,
                default=None,
                help=f"List of {{type: Name, arg: value, ...}} entries or bare names; Name is one of "
                f"{', '.join(registry.list())} or a dotted path. Default: the config's default.",
            )
    params = init_params(trainer_cls)
    if params:
        group = parser.add_argument_group(
            f"{trainer_cls.__name__}.__init__ arguments",
            "Values of non-plain parameters (nn.Module, ...) given as {type: Name, ...} are built through "
            "the registries; dict parameters receive the raw config.",
        )
    for p in params:
        if p.name in names or p.name in _RESERVED:
            raise CLIError(
                f"{trainer_cls.__name__}.__init__ parameter {p.name!r} clashes with "
                f"{'a config field' if p.name in names else 'a ' + PROG + ' option'} of the same name; rename it"
            )
        kwargs: dict[str, Any] = {"type": p.cli_type, "help": _param_help(p)}
        if p.default is _EMPTY:
            kwargs["required"] = True
        else:
            kwargs["default"] = p.default if is_plain_value(p.default) else None
        group.add_argument(f"--{p.name}", **kwargs)
    return parser


def _param_help(p: InitParam) -> str:
    if not p.build:
        return "Passed to __init__ as given."
    shown = "no annotation" if p.annotation is _EMPTY else getattr(p.annotation, "__name__", str(p.annotation))
    return f"A {{type: Name, ...}} config (or a name), built through the registries ({shown})."


def _enable_field_docs() -> None:
    """Show each config field's attribute docstring in --help (needs docstring-parser)."""
    try:
        from jsonargparse import set_parsing_settings

        set_parsing_settings(docstring_parse_attribute_docstrings=True)
    except (ImportError, ValueError):  # an old jsonargparse or no docstring-parser: no field docs
        pass


def _find_target(rest: list[str]) -> tuple[str | None, tuple[Path, ...], list[str]]:
    """The trainer: the first positional, else `--trainer X`, else a `trainer:` key in a --config file.
    A positional is moved to a final `--trainer X`, so it beats any config file's `trainer:`.
    Every --config file is read here, so a missing or broken one is reported before anything is imported."""
    configs = {value: read_config_file(value) for value in config_arguments(rest)}
    if rest and not rest[0].startswith("-"):
        return rest[0], (), [*rest[1:], "--trainer", rest[0]]
    target: str | None = None
    search: tuple[Path, ...] = ()
    for i, arg in enumerate(rest):
        value = rest[i + 1] if i + 1 < len(rest) else None
        if arg.startswith("--trainer="):
            target, search = arg.split("=", 1)[1], ()
        elif arg == "--trainer" and value is not None:
            target, search = value, ()
        elif arg.startswith("--config=") or (arg == "--config" and value is not None):
            name = arg.split("=", 1)[1] if "=" in arg else str(value)
            data = configs[name]
            if data is not None and isinstance(data.get("trainer"), str):
                target, search = data["trainer"], (Path(name).parent,)
    return target, search, rest


def _parse(parser: ArgumentParser, rest: list[str]) -> Namespace:
    """`parser.parse_args(rest)`; a bad flag, key or value raises `CLIError` whose first line says what to
    change: every unknown key of a `--config` file (with its line) and every unknown flag, each with
    Lightning's name mapped (`--accumulate_grad_batches`: write `--gradient_accumulation_steps`) or the
    closest known one."""
    check_config_keys(rest, {a.dest for a in parser._actions})
    try:
        return parser.parse_args(rest)
    except ArgumentError as exc:
        message = _type_error(str(exc)) or one_line(str(exc))
        options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        bad = re.findall(r"(--[\w.-]+)", message) + [f"--{k}" for k in re.findall(r"Option '([\w.-]+)'", message)]
        if DEBUG_FLAG in bad and DEBUG_FLAG not in options:
            message += f" ({DEBUG_FLAG} goes before the command: {PROG} {DEBUG_FLAG} {parser.prog.split()[-1]} ...)"
        unknown = [b for b in bad if b not in options and b != DEBUG_FLAG]
        if unknown:
            message = unknown_flags_message(message, unknown, options)
        raise CLIError(message) from exc


def _type_error(message: str) -> str | None:
    """jsonargparse's several-line report of a value of the wrong type, as `key = 'value' is invalid: expected
    int or null`; None for any other message."""
    key = re.match(r'Parser key "([^"]+)":', message)
    given = re.search(r"(?:Given|Got) value: (.*)$", message, re.MULTILINE)
    expected = re.findall(r"Expected an? <class '([\w.]+)'>", message)
    if key is None or given is None or not expected:
        return None
    names = [{"NoneType": "null"}.get(n, n) for n in dict.fromkeys(expected)]
    return f"{key.group(1)} = {given.group(1).strip()!r} is invalid: expected {' or '.join(names)}"


# --- building config and trainer ---------------------------------------------------------------------
def instantiate(trainer_cls: type[DreamTrainer], ns: Namespace) -> DreamTrainer:
    """Build the config (validated: a bad value raises `ConfigError`), callbacks, loggers and the
    extra `__init__` arguments from a parsed namespace, then the trainer."""
    config_cls = config_class_of(trainer_cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if not f.init or f.name not in ns:
            continue
        value = ns.get(f.name)
        if f.name in _LISTED:
            if value is None:
                continue  # the config's own default
            value = _build_entries(f.name, value, _LISTED[f.name])
        values[f.name] = value
    config = config_cls(**values)  # ConfigError names the field and what is valid
    kwargs: dict[str, Any] = {}
    for p in init_params(trainer_cls):
        value = ns.get(p.name)
        if value is None and not (p.default is None or p.default is _EMPTY):
            continue  # not given: the __init__ default applies
        if p.build and value is not None:
            if isinstance(value, str) and p.annotation not in (_EMPTY, None, Any):
                value = {"type": value}  # `--model MyNet` for a class-typed parameter
            try:
                value = build_nested(value)
            except (RegistryError, ConfigError) as exc:
                raise CLIError(f"{p.name}: {exc}") from exc
        kwargs[p.name] = value
    return trainer_cls(config, **kwargs)


def _build_entries(field: str, entries: list[Any], registry: Registry[Any]) -> list[Any]:
    built = []
    for i, entry in enumerate(entries):
        cfg = {"type": entry} if isinstance(entry, str) else entry
        try:
            built.append(registry.build(cfg))
        except (RegistryError, ConfigError) as exc:
            raise CLIError(f"{field}[{i}]: {exc}") from exc
    return built
