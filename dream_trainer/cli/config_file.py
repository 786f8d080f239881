"""The YAML files `--config` names, read before the parser is built: for the `trainer:` they name, and to
report a broken file by its name, line and column (jsonargparse's message names neither, over several lines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dream_trainer.cli.loading import CLIError


def config_arguments(argv: list[str]) -> list[str]:
    """The values of every `--config VALUE` and `--config=VALUE` in `argv`, in order."""
    values = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            values.append(arg.split("=", 1)[1])
        elif arg == "--config" and i + 1 < len(argv):
            values.append(argv[i + 1])
    return values


def read_config_file(value: str) -> dict[str, Any] | None:
    """The top-level mapping of the YAML file `value` names.

    None when `value` is no file but a YAML mapping itself (`--config '{n_epochs: 3}'`, which the parser
    takes as it is). Raises `CLIError` naming the file when it is missing or unreadable, is not valid
    YAML (with the line and column), or does not hold `field: value` pairs at its top level.
    """
    path = Path(value)
    if not path.is_file():
        try:
            inline = yaml.safe_load(value)
        except yaml.YAMLError:
            inline = None
        if isinstance(inline, dict):
            return None
        raise CLIError(f"--config {value}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"--config {value}: cannot read it ({exc})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CLIError(f"--config {value}: invalid YAML {_where(exc)}; fix the file") from exc
    if data is None:  # an empty file (or only comments): nothing to set
        return {}
    if not isinstance(data, dict):
        raise CLIError(
            f"--config {value}: expected `field: value` lines at the top level, found a {type(data).__name__}"
        )
    return data


def top_level_key_lines(value: str) -> dict[str, int]:
    """The line (1-based) of each top-level key of the YAML file `value` names (read by `read_config_file`
    already, so it exists and parses)."""
    node = yaml.compose(Path(value).read_text(), Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(key.value): key.start_mark.line + 1 for key, _ in node.value}


def _where(exc: yaml.YAMLError) -> str:
    """`at line L, column C: <problem>` from a PyYAML error (1-based, as editors count)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{where}: {problem}".split()) if where else " ".join(problem.split())
