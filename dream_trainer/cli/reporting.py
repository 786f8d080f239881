"""How `dream-trainer` reports a failure: one line on stderr and an exit status, or the traceback.

The line is the first line of the error's message: what went wrong and what to do. Its short details
(each unknown key of a YAML file, with its line) follow, indented, one per line; long ones (every
registered name) are left to `--debug`, which the line then mentions.

- Exit status 2 (`EXIT_USAGE`): the command line or the config is wrong (an unknown flag or key, a bad
  value, unreadable YAML, a trainer that cannot be found or imported): `CLIError`, `ConfigError`,
  `RegistryError`.
- Exit status 1 (`EXIT_RUN`): the command is well formed but the run cannot go on, and dream_trainer
  says why: the trainer lacks the step the command runs (`MisconfigurationError`), the checkpoint is
  missing or unreadable or `--ckpt_path last` finds none (`CheckpointError`), and every other
  `DreamTrainerError`.
- Any other exception is not reported here: it comes from the trainer's own code (or is a bug in
  dream_trainer), and its traceback is what finds it, so it propagates (Python prints it; status 1).

`--debug` (before the command) prints the full traceback of the errors above too, with the same status.
"""

from __future__ import annotations

import sys
import traceback
from typing import TextIO

from dream_trainer.cli.loading import CLIError
from dream_trainer.errors import ConfigError, DreamTrainerError
from dream_trainer.registry import RegistryError

EXIT_USAGE = 2
EXIT_RUN = 1
DEBUG_FLAG = "--debug"
MAX_DETAIL_LINES = 20  # an error's lines below its first: more (or longer) are left to --debug
MAX_DETAIL_CHARS = 300
USAGE_ERRORS: tuple[type[Exception], ...] = (CLIError, ConfigError, RegistryError)


def exit_status(exc: BaseException) -> int | None:
    """The exit status `exc` ends the command with, or None when it is not a user error (let it propagate)."""
    if isinstance(exc, USAGE_ERRORS):
        return EXIT_USAGE
    if isinstance(exc, DreamTrainerError):
        return EXIT_RUN
    return None


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(text.split())


def error_message(exc: BaseException) -> str:
    """The first line of `exc`'s message, whitespace collapsed (its class name when it has none)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return one_line(lines[0]) if lines else type(exc).__name__


def error_details(exc: BaseException) -> list[str]:
    """The lines of `exc`'s message below the first (each unknown key, ...), or [] when they are long
    (a listing of every registered name): `--debug` shows those."""
    details = [line.rstrip() for line in str(exc).splitlines()[1:] if line.strip()]
    if len(details) > MAX_DETAIL_LINES or any(len(line) > MAX_DETAIL_CHARS for line in details):
        return []
    return details


def report(exc: BaseException, prog: str, debug: bool = False, stream: TextIO | None = None) -> None:
    """Print `exc` as `<prog>: error: <first line>`, then its short detail lines indented (long ones: a
    note that `--debug` shows them); with `debug`, its full traceback comes first."""
    stream = sys.stderr if stream is None else stream
    if debug:
        traceback.print_exception(exc, file=stream)
    first = error_message(exc)
    details = error_details(exc)
    hidden = not debug and not details and len(str(exc).strip().splitlines()) > 1
    if hidden:
        first += f" ({prog.split()[0]} {DEBUG_FLAG} ... shows the details)"
    print(f"{prog}: error: {first}", file=stream, flush=True)
    for line in details:
        print(f"  {line.strip()}", file=stream, flush=True)


def split_debug(argv: list[str]) -> tuple[bool, list[str]]:
    """`(debug, argv without it)`: `--debug` is a global flag, given before the command.

    Only there: after the command every `--NAME` belongs to the trainer's config, which may have a
    field of that name.
    """
    debug = False
    while argv and argv[0] == DEBUG_FLAG:
        debug, argv = True, argv[1:]
    return debug, argv
