"""What to write instead of a flag or YAML key the trainer's parser does not know: Lightning's `Trainer`
argument mapped to the field (the table Python's `DreamTrainerConfig(max_epochs=2)` error reads), else
the closest known name. Every unknown key of every `--config` file is reported at once, with its line."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

from dream_trainer.cli.config_file import config_arguments, read_config_file, top_level_key_lines
from dream_trainer.cli.loading import CLIError
from dream_trainer.lightning.trainer_args import OLDER_TRAINER_ARGUMENTS, TRAINER_ARGUMENTS

MAX_FIRST_LINE = 300


def as_flag(name: str) -> str:
    return f"--{name}"


def as_key(name: str) -> str:
    return f"{name}:"


def unknown_name_hint(name: str, known: Iterable[str], spell: Callable[[str], str], named: bool = True) -> str:
    """What to write instead of the unknown `name`, spelt as a flag (`as_flag`) or a YAML key (`as_key`):
    `--max_epochs is Lightning's Trainer argument; here write --n_epochs (the same meaning)` (without
    the name when not `named`), or `did you mean --n_epochs?`, or that the trainer has no such setting."""
    moved = TRAINER_ARGUMENTS.get(name) or OLDER_TRAINER_ARGUMENTS.get(name)
    lightning = (
        f"{spell(name).rstrip(':')} is Lightning's Trainer argument" if named else "Lightning's Trainer argument"
    )
    if moved is not None and moved.field is None:
        return f"{lightning}; here it is not a config field: {moved.note}"
    if moved is not None and moved.field is not None:
        return f"{lightning}; here write {spell(moved.field)} ({moved.note})"
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {spell(close[0]).rstrip(':')}?"
    return "the trainer's config and __init__ have no such name (--help lists them)"


def message(head: str, items: list[str]) -> str:
    """`head (item)` on one line when there is one short item; else `head`, and each item on a line below."""
    if len(items) == 1 and len(head) + len(items[0]) + 3 <= MAX_FIRST_LINE:
        return f"{head} ({items[0]})"
    return head + "".join(f"\n{item}" for item in items)


def check_config_keys(argv: list[str], known: set[str]) -> None:
    """`CLIError` naming every top-level key of every `--config` file in `argv` that is not in `known`,
    each with its file, line and what to write instead. Inline `--config '{...}'` mappings are left to
    the parser."""
    unknown: list[tuple[str, str, int]] = []  # (file, key, line)
    for value in config_arguments(argv):
        data = read_config_file(value)
        if data is None:
            continue
        lines = top_level_key_lines(value)
        unknown += [(value, str(key), lines.get(str(key), 0)) for key in data if str(key) not in known]
    if not unknown:
        return
    files = list(dict.fromkeys(f for f, _, _ in unknown))
    where = f"--config {files[0]}" if len(files) == 1 else "--config files"
    if len(unknown) == 1:
        _, key, line = unknown[0]
        hint = unknown_name_hint(key, known, as_key)
        raise CLIError(message(f"{where}, line {line}: unknown key {key!r}", [hint]))
    listed = ", ".join(f"{key!r} (line {line})" for _, key, line in unknown)
    head = f"{where}: {len(unknown)} unknown keys: {listed}; fix or remove each (below)"
    if len(head) > MAX_FIRST_LINE:
        head = f"{where}: {len(unknown)} unknown keys; fix or remove each (below)"
    items = [
        f"  {'' if len(files) == 1 else file + ', '}line {line}: {key}: {unknown_name_hint(key, known, as_key, False)}"
        for file, key, line in unknown
    ]
    raise CLIError(head + "".join(f"\n{item}" for item in items))


def unknown_flags_message(text: str, flags: list[str], options: list[str]) -> str:
    """jsonargparse's `unrecognized arguments: --a 1 --b 2` (`text`), with what to write for each flag."""
    known = [o[2:] for o in options]
    unique = list(dict.fromkeys(flags))
    if len(unique) == 1:
        return message(text, [unknown_name_hint(unique[0][2:], known, as_flag)])
    return message(text, [f"  {flag}: {unknown_name_hint(flag[2:], known, as_flag, named=False)}" for flag in unique])
