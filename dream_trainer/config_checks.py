"""The rules `DreamTrainerConfig.validate` applies to its own fields, as one table (`FIELD_RULES`).

A rule is a function of the field's value that returns None when the value is valid, else what is valid
(the end of the error: `DreamTrainerConfig.<field> = <value> is invalid: <what is valid>.`). Rules run in
the table's order and the first failure is raised, so a config with several bad fields names the one
highest in the table. Rules across fields (retries with accumulation, a mesh degree with the "ddp"
strategy, the default epoch count) stay in `validate`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

Rule = Callable[[Any], str | None]

MIXED_PRECISION_CHOICES = (None, "bf16", "fp16")
CLIP_ALGORITHMS = ("norm", "value")
SCHEDULER_INTERVALS = ("epoch", "step")
NON_FINITE_POLICIES = ("ignore", "raise", "skip", "retry")
NON_FINITE_LOSS_POLICIES = ("raise", "warn", "ignore")
SPIKE_POLICIES = ("off", "warn", "skip", "rollback")
REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", None)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
INIT_DEVICES = (None, "meta")
ACTIVATION_CHECKPOINTING = (None, "full", "selective")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "expected True or False"


def positive_int(allow_none: bool = False, valid: str | None = None) -> Rule:
    said = valid or "expected a positive integer (1, 2, ...)" + (" or None" if allow_none else "")

    def rule(v: Any) -> str | None:
        return None if (v is None and allow_none) or (is_int(v) and v > 0) else said

    return rule


def int_at_least(low: int, valid: str) -> Rule:
    return lambda v: None if is_int(v) and v >= low else valid


def positive_number(valid: str, allow_none: bool = False) -> Rule:
    return lambda v: None if (v is None and allow_none) or (is_number(v) and v > 0) else valid


def one_of(choices: tuple[Any, ...]) -> Rule:
    valid = "valid choices are " + ", ".join(repr(c) for c in choices)
    return lambda v: None if v in choices else valid


def path(valid: str, allow_none: bool = False) -> Rule:
    return lambda v: None if (v is None and allow_none) or isinstance(v, (str, os.PathLike)) else valid


def batch_limit(v: Any) -> str | None:
    if v is None or (is_int(v) and v >= 0) or (isinstance(v, float) and 0.0 <= v <= 1.0):
        return None
    return "expected None (all), an int >= 0 (batches) or a float in [0.0, 1.0] (fraction)"


def trains_something(v: Any) -> str | None:
    return "0 would train on nothing; use None for all" if v == 0 else None


def seed(v: Any) -> str | None:
    return None if v is None or is_int(v) else "expected an integer or None"


def metric_name(v: Any) -> str | None:
    return None if isinstance(v, str) and v else "expected a metric name such as 'val_loss'"


def skip_list(v: Any) -> str | None:
    if v is None or isinstance(v, (str, os.PathLike, list, tuple)):
        return None
    return "expected None, [[epoch, batch_idx], ...] or a JSON file path"


def device(v: Any) -> str | None:
    if not isinstance(v, str) or not _DEVICE_RE.match(v):
        return "valid choices are 'auto', 'cpu', 'cuda', 'cuda:N' and 'mps'"
    if v.startswith("cuda"):
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine; use 'auto' or 'cpu'"
        index = int(v.split(":")[1]) if ":" in v else 0
        if index >= torch.cuda.device_count():
            return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    if v == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available on this machine; use 'auto' or 'cpu'"
    return None


def dp_shard(v: Any) -> str | None:
    return None if is_int(v) and (v >= 1 or v == -1) else "expected a positive integer, or -1 for the ranks left"


def run_name(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v or os.sep in v or "/" in v or v.startswith("."):
        return "expected None or a directory name without path separators"
    if v in ("checkpoints", "logs"):
        return f"<root_dir>/{v} is where earlier versions wrote (read by resume, never written); choose another name"
    return None


def _each(names: str, rule: Rule) -> list[tuple[str, Rule]]:
    return [(name, rule) for name in names.split()]


def field_rules(strategies: tuple[str, ...]) -> tuple[tuple[str, Rule], ...]:
    """The table, in the order the fields are checked (`strategies`: the valid `strategy` values)."""
    seconds = positive_number("expected a positive number of seconds, or None (not watched)", allow_none=True)
    return (
        ("seed", seed),
        *_each("n_epochs max_steps", positive_int(allow_none=True)),
        *_each("limit_train_batches limit_val_batches limit_test_batches limit_predict_batches", batch_limit),
        ("limit_train_batches", trains_something),
        ("reload_dataloaders_every_n_epochs", int_at_least(0, "expected 0 (load once) or a positive int")),
        ("deterministic", one_of((False, True, "warn"))),
        ("detect_anomaly", boolean),
        *_each("val_every_n_epochs val_every_n_steps", positive_int(allow_none=True)),
        *_each("val_at_start val_restores_rng", boolean),
        ("num_sanity_val_steps", int_at_least(-1, "expected -1 (all), 0 (off) or a positive int")),
        ("gradient_accumulation_steps", positive_int()),
        ("gradient_clip_val", positive_number("expected a positive number or None", allow_none=True)),
        ("gradient_clip_algorithm", one_of(CLIP_ALGORITHMS)),
        ("scheduler_interval", one_of(SCHEDULER_INTERVALS)),
        ("scheduler_monitor", metric_name),
        ("non_finite_grads", one_of(NON_FINITE_POLICIES)),
        ("non_finite_loss", one_of(NON_FINITE_LOSS_POLICIES)),
        ("spike_policy", one_of(SPIKE_POLICIES)),
        ("spike_threshold", positive_number("expected a positive number (standard deviations above the mean)")),
        *_each("spike_window spike_snapshot_every", positive_int()),
        ("spike_warmup", int_at_least(2, "expected an int >= 2 (a std needs two losses)")),
        ("skip_batches", skip_list),
        ("max_non_finite_retries", int_at_least(1, "expected a positive integer")),
        ("mixed_precision", one_of(MIXED_PRECISION_CHOICES)),
        ("compile_model", boolean),
        ("device", device),
        ("strategy", one_of(strategies)),
        *_each(
            "dp_replicate tensor_parallel pipeline_parallel context_parallel",
            positive_int(valid="expected a positive integer (1 turns it off)"),
        ),
        ("dp_shard", dp_shard),
        ("pipeline_schedule", one_of(PIPELINE_SCHEDULES)),
        ("pipeline_microbatches", positive_int(allow_none=True, valid="expected None or a positive integer")),
        ("init_device", one_of(INIT_DEVICES)),
        ("activation_checkpointing", one_of(ACTIVATION_CHECKPOINTING)),
        ("float8", boolean),
        *_each("find_unused_parameters fsdp_cpu_offload fsdp_sharded_checkpoints", boolean),
        ("process_group_timeout", positive_number("expected a positive number of seconds")),
        *_each("hang_timeout hang_timeout_first_step", seconds),
        ("root_dir", path("expected a path (str or pathlib.Path)")),
        ("resume_from", path("expected None, 'last' or a checkpoint path", allow_none=True)),
        *_each("async_checkpointing checkpoint_crc32 handle_signals", boolean),
        ("requeue_signal", one_of(REQUEUE_SIGNALS)),
        ("log_every_n_steps", positive_int()),
        *_each("print_epoch_summary enable_progress_bar enable_checkpointing", boolean),
        ("run_name", run_name),
    )
