"""The largest batch size that fits in memory (Lightning's `Tuner.scale_batch_size`).

The batch size lives where `configure_dataloaders` reads it: an attribute of the trainer
(`self.batch_size`, the default `batch_arg_name`), else a field of its config. Each trial sets it,
builds the loaders again (`configure_dataloaders`), and runs `steps_per_trial` optimizer steps through
the trainer's own training step, from the same saved state every time. A trial fails on out-of-memory
only (`is_oom_error`); any other error propagates. "power" doubles the size until a trial fails and
keeps the last one that fitted; "binsearch" doubles too, then bisects between the largest size that
fitted and the smallest that did not. The size never grows past the training set's length.

Afterwards the trainer is restored (weights, optimizer, RNG, counters; see `tuning_session`), the
found value is set, and the loaders are built with it, so `fit()` trains with it.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable
from typing import Any

import torch

from dream_trainer.errors import MisconfigurationError
from dream_trainer.trainer import DreamTrainer
from dream_trainer.tuner.session import TrainerSnapshot, cycle_batches, tuning_session
from dream_trainer.utils.seed import rng_state, set_rng_state

MODES = ("power", "binsearch")
_OOM_MESSAGES = (
    "out of memory",  # CUDA, MPS and others
    "can't allocate memory",  # CPU: DefaultCPUAllocator
    "DefaultCPUAllocator",
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's way of saying a workspace did not fit
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuFFT error: CUFFT_ALLOC_FAILED",
)


def is_oom_error(exc: BaseException) -> bool:
    """True for an out-of-memory error: `torch.OutOfMemoryError` (CUDA's included), or a `RuntimeError`
    whose message says memory could not be allocated (CPU, MPS, cuDNN)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def free_memory() -> None:
    """Release what a failed trial left: unreachable tensors, and the CUDA caching allocator's blocks."""
    gc.collect()
    if torch.cuda.is_initialized():  # (is_available() would start the CUDA driver)
        torch.cuda.empty_cache()


def scale_batch_size(
    trainer: DreamTrainer,
    mode: str = "power",
    init_val: int = 2,
    max_trials: int = 25,
    steps_per_trial: int = 3,
    batch_arg_name: str = "batch_size",
) -> int:
    """Find the largest batch size that trains without running out of memory; set it and return it.

    Args:
        trainer: the trainer (set up here if `fit()` has not run). One process only.
        mode: "power" (double until a trial fails) or "binsearch" (then bisect to the exact boundary).
        init_val: the first size tried.
        max_trials: trials at most (each one a few training steps).
        steps_per_trial: optimizer steps per trial.
        batch_arg_name: the trainer attribute (else config field) `configure_dataloaders` reads.
    """
    _check_arguments(trainer, mode, init_val, max_trials, steps_per_trial)
    owner = _owner_of(trainer, batch_arg_name)
    original = getattr(owner, batch_arg_name)
    found: int | None = None
    started = False
    try:
        with tuning_session(trainer, "scale_batch_size") as snapshot:
            started = True

            def fits(size: int) -> bool:
                return _trial(trainer, snapshot, owner, batch_arg_name, size, steps_per_trial)

            max_val = _dataset_length(trainer)
            search = _power if mode == "power" else _binsearch
            found = search(fits, min(init_val, max_val), max_trials, max_val)
    finally:
        if started:  # trials changed the value and the loaders: leave the found (or original) ones
            setattr(owner, batch_arg_name, original if found is None else found)
            _rebuild_loaders(trainer)
    if trainer.is_global_zero:
        print(f"dream_trainer: scale_batch_size found {batch_arg_name}={found} ({mode})", file=sys.stderr)
    return found


def _power(fits: Callable[[int], bool], size: int, max_trials: int, max_val: int) -> int:
    """Double while trials succeed; after the first failure, the last size that fitted."""
    best: int | None = None
    for _ in range(max_trials):
        if fits(size):
            best = size
            if size >= max_val:
                break
            size = min(size * 2, max_val)
        elif best is not None:
            break
        else:  # nothing fitted yet: halve until something does
            size = _smaller(size)
    return _result(best, max_trials)


def _binsearch(fits: Callable[[int], bool], size: int, max_trials: int, max_val: int) -> int:
    """Double while trials succeed, then bisect between the largest fitting and smallest failing size."""
    best: int | None = None
    failed: int | None = None
    for _ in range(max_trials):
        if fits(size):
            best = size
            if size >= max_val:
                break
            size = min(size * 2, max_val) if failed is None else (size + failed) // 2
        else:
            failed = size
            size = _smaller(size) if best is None else (best + failed) // 2
        if best is not None and failed is not None and failed - best <= 1:
            break
    return _result(best, max_trials)


def _smaller(size: int) -> int:
    if size <= 1:
        raise MisconfigurationError(
            "scale_batch_size: even a batch of 1 runs out of memory: the model itself does not fit; "
            "try mixed_precision='bf16', activation_checkpointing or a smaller model"
        )
    return size // 2


def _result(best: int | None, max_trials: int) -> int:
    if best is None:
        raise MisconfigurationError(
            f"scale_batch_size: no batch size fitted in {max_trials} trials (max_trials); raise max_trials "
            "or lower init_val"
        )
    return best


def _trial(trainer: DreamTrainer, snapshot: TrainerSnapshot, owner: Any, name: str, size: int, steps: int) -> bool:
    """Train `steps` optimizer steps at batch size `size` from the snapshot; False on out-of-memory."""
    snapshot.restore()
    setattr(owner, name, size)
    failed = False
    try:
        _rebuild_loaders(trainer)
        loop = trainer.loop
        done = 0
        for batch_idx, batch in cycle_batches(trainer):
            trainer.training_step(batch, batch_idx)
            if loop.window_pos == 0:
                done += 1
                if done >= steps:
                    break
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not is_oom_error(exc):
            raise
        failed = True  # leave the except block first: its traceback holds the trial's tensors
    if failed:
        free_memory()
    return not failed


def _rebuild_loaders(trainer: DreamTrainer) -> None:
    """Build the loaders again from `configure_dataloaders` (as setup does), leaving the RNG as it was."""
    state = rng_state()
    try:
        loaders = trainer.configure_dataloaders()
        train, val = loaders if isinstance(loaders, (tuple, list)) and len(loaders) == 2 else (loaders, None)
        trainer.use_dataloaders(train, val)
    finally:
        set_rng_state(state)


def _dataset_length(trainer: DreamTrainer) -> int:
    """The training set's length (no batch is larger), or a practically unbounded size when unknown."""
    dataset = getattr(trainer.train_loader.loader, "dataset", None)
    try:
        return max(1, len(dataset))  # type: ignore[arg-type]  # any Sized dataset; TypeError otherwise
    except TypeError:
        return sys.maxsize


def _owner_of(trainer: DreamTrainer, name: str) -> Any:
    """Where the batch size lives: the trainer attribute `name`, else the config field `name`."""
    if name in vars(trainer) or isinstance(getattr(type(trainer), name, None), property):
        return trainer
    if name in {f.name for f in dataclasses.fields(trainer.config)}:
        return trainer.config
    raise MisconfigurationError(
        f"scale_batch_size(batch_arg_name={name!r}): neither {type(trainer).__name__}.{name} nor "
        f"config.{name} exists. configure_dataloaders must read the batch size from one of them, e.g. "
        f"self.{name} = 32 in __init__ and DataLoader(..., batch_size=self.{name})"
    )


def _check_arguments(trainer: DreamTrainer, mode: str, init_val: int, max_trials: int, steps_per_trial: int) -> None:
    if mode not in MODES:
        raise ValueError(f"scale_batch_size(mode={mode!r}) is invalid: valid choices are {', '.join(map(repr, MODES))}")
    for name, value in (("init_val", init_val), ("max_trials", max_trials), ("steps_per_trial", steps_per_trial)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"scale_batch_size({name}={value!r}) is invalid: expected a positive integer")
    if trainer.is_distributed:
        raise MisconfigurationError(
            "scale_batch_size runs on one process: an out-of-memory error on one rank would leave the others "
            "waiting in a collective. Run it without torchrun (the batch size is per process), then train "
            "with the value it finds"
        )
