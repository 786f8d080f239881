"""Hold optimizer steps back until a background copy of their state is done.

An asynchronous checkpoint must write the state as it was when `save_checkpoint` was called. Most
of its bytes are the optimizers' per-parameter state (Adam: two tensors per parameter), which
only `optimizer.step()` changes. So the save copies everything else at once and leaves that part
to the background thread; a step pre-hook on each optimizer makes the next `step()` wait for the
copy. Forward and backward of the next batch run meanwhile, beside the copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from torch.optim import Optimizer


class StepFence:
    """`arm(optimizers)` returns an event; until it is set, those optimizers' `step()` waits."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def arm(self, optimizers: Iterable[Optimizer]) -> threading.Event:
        self.release()
        done = threading.Event()

        def wait_for_copy(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            if not done.is_set():
                done.wait()  # SYNC: only the first step after an async save, if its copy is still running

        self._handles = [opt.register_step_pre_hook(wait_for_copy) for opt in optimizers]
        return done

    def release(self) -> None:
        """Remove the hooks. Call from the training thread, never from inside `optimizer.step()`,
        and only once the event is set (after waiting for the background work)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
