"""Seeding and RNG state capture."""

from __future__ import annotations

import os
import random
from typing import Any, cast

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, NumPy (if installed) and torch on every device."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """The state of every RNG the training loop touches, as checkpoint-safe values."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, gauss = cast("tuple[str, Any, int, int, float]", np.random.get_state())
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    # is_initialized() alone: is_available() starts the CUDA driver, which a CPU run on a GPU machine never needs.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def use_deterministic_algorithms(warn_only: bool = False) -> None:
    """Deterministic kernels everywhere (`config.deterministic`): torch's switch, cuDNN's flags and the
    cuBLAS workspace setting CUDA needs for it (set only if the environment has none). Process-wide."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
