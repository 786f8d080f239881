"""The oldest torch this package runs on, checked when `dream_trainer` is imported.

`MIN_TORCH` is the floor of `torch` in pyproject.toml (a test keeps the two equal), the release CI installs
in its lowest-versions run. An older torch gets one ImportError that says what to install, instead of an
AttributeError deep in a step.
"""

from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 13)


def check_torch(version: str) -> None:
    """Raise ImportError when `version` (torch.__version__, e.g. "2.6.0+cu124") is older than MIN_TORCH."""
    found = tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:2])
    if found < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"dream_trainer needs torch>={floor}, found torch {version}: pip install 'torch>={floor}' "
            "(the CPU-only build: add --index-url https://download.pytorch.org/whl/cpu)\n"
            f"CI runs the suite on torch {floor} as the oldest release; older releases are not tested."
        )


check_torch(torch.__version__)  # on import: `dream_trainer/__init__.py` imports this module first
