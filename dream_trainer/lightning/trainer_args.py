"""Lightning's `Trainer` arguments and where each went here: `TRAINER_ARGUMENTS` (and
`OLDER_TRAINER_ARGUMENTS`), Lightning's argument -> the config field (or None, and why).

Used by the config's error for an unknown field (`DreamTrainerConfig(max_epochs=2)` says to write
`n_epochs`) and by the CLI's name hints; tests check the tables against docs/migrating-from-lightning.md.
Apart from `lightning/names.py` (the module's and the callbacks' names, which read the hook list): the
config imports this module, and it imports nothing of the package.
"""

from __future__ import annotations

from typing import NamedTuple


class Moved(NamedTuple):
    """Where a Lightning `Trainer` argument went: a config field (`field`), or nowhere (None) and why."""

    field: str | None
    note: str


TRAINER_ARGUMENTS: dict[str, Moved] = {
    "accelerator": Moved("device", '"auto", "cpu", "cuda", "cuda:N" or "mps"'),
    "strategy": Moved("strategy", '"auto", "ddp", "fsdp" (FSDP2) or "model_parallel"'),
    "devices": Moved("device", "one process per device: the number of processes comes from torchrun"),
    "num_nodes": Moved(
        None, "torchrun --nnodes (or srun) starts the processes; the trainer reads WORLD_SIZE (or SLURM_NTASKS)"
    ),
    "precision": Moved("mixed_precision", '"bf16-mixed" -> "bf16", "16-mixed" -> "fp16", "32" -> None'),
    "logger": Moved("loggers", "a list of loggers; [] for none (logger=False)"),
    "callbacks": Moved("callbacks", "the same"),
    "fast_dev_run": Moved("fast_dev_run", "the same; the run directory is temporary and deleted"),
    "max_epochs": Moved("n_epochs", "the same meaning"),
    "min_epochs": Moved(None, "not supported: EarlyStopping(min_delta=..., patience=...) decides when to stop"),
    "max_steps": Moved(
        "max_steps", "counts training steps (batches), not optimizer steps: with 2 optimizers halve Lightning's"
    ),
    "min_steps": Moved(None, "not supported"),
    "max_time": Moved(None, "use the Timer callback: Timer(duration=...)"),
    "limit_train_batches": Moved("limit_train_batches", "the same"),
    "limit_val_batches": Moved("limit_val_batches", "the same"),
    "limit_test_batches": Moved("limit_test_batches", "the same"),
    "limit_predict_batches": Moved("limit_predict_batches", "the same"),
    "overfit_batches": Moved("overfit_batches", "the same: the first batches, in order, validated on too"),
    "val_check_interval": Moved("val_every_n_steps", "in training steps (accumulation windows)"),
    "check_val_every_n_epoch": Moved("val_every_n_epochs", "the same meaning"),
    "num_sanity_val_steps": Moved("num_sanity_val_steps", "the same"),
    "log_every_n_steps": Moved("log_every_n_steps", "the same"),
    "enable_checkpointing": Moved("enable_checkpointing", "the same"),
    "enable_progress_bar": Moved("enable_progress_bar", "the same"),
    "enable_model_summary": Moved(None, "attach the ModelSummary callback"),
    "accumulate_grad_batches": Moved("gradient_accumulation_steps", "the same meaning"),
    "gradient_clip_val": Moved("gradient_clip_val", "the same"),
    "gradient_clip_algorithm": Moved("gradient_clip_algorithm", "the same"),
    "deterministic": Moved("deterministic", 'True or "warn", as Lightning'),
    "benchmark": Moved(None, "set torch.backends.cudnn.benchmark yourself"),
    "inference_mode": Moved(None, "evaluation always runs under torch.no_grad()"),
    "use_distributed_sampler": Moved(None, "a plain DataLoader gets a DistributedSampler; pass your own sampler"),
    "profiler": Moved(None, "attach the Profiler callback (torch.profiler)"),
    "detect_anomaly": Moved("detect_anomaly", "the same"),
    "barebones": Moved(None, "not needed: the defaults cost ~1.06x a plain loop"),
    "plugins": Moved(
        None, "not supported (SLURMEnvironment's requeue is built in: requeue_signal, docs/unattended.md)"
    ),
    "sync_batchnorm": Moved(None, "convert with torch.nn.SyncBatchNorm.convert_sync_batchnorm in configure_models"),
    "reload_dataloaders_every_n_epochs": Moved("reload_dataloaders_every_n_epochs", "the same"),
    "default_root_dir": Moved("root_dir", "runs go to <root_dir>/version_N"),
}
"""Every argument of Lightning 2.x's `Trainer`, by name."""

OLDER_TRAINER_ARGUMENTS: dict[str, Moved] = {
    "gpus": Moved("device", 'Lightning 1.x; "cuda" (one process per GPU: torchrun starts them)'),
    "tpu_cores": Moved(None, "Lightning 1.x; TPUs are not supported"),
    "num_processes": Moved(None, "Lightning 1.x; torchrun --nproc-per-node starts the processes"),
    "resume_from_checkpoint": Moved("resume_from", 'Lightning 1.x; a checkpoint path, or "last"'),
    "checkpoint_callback": Moved("enable_checkpointing", "Lightning 1.x"),
    "weights_save_path": Moved("root_dir", "Lightning 1.x"),
    "weights_summary": Moved(None, "Lightning 1.x; attach the ModelSummary callback"),
    "progress_bar_refresh_rate": Moved("enable_progress_bar", "Lightning 1.x; 0 -> False"),
    "terminate_on_nan": Moved("non_finite_loss", 'Lightning 1.x; "raise" (the default) stops on a NaN loss'),
    "track_grad_norm": Moved(None, "Lightning 1.x; attach the GradientNormMonitor callback"),
    "auto_lr_find": Moved(None, "Lightning 1.x; Tuner(trainer).lr_find()"),
    "auto_scale_batch_size": Moved(None, "Lightning 1.x; Tuner(trainer).scale_batch_size()"),
    "replace_sampler_ddp": Moved(None, "Lightning 1.x use_distributed_sampler: a plain DataLoader gets one"),
    "stochastic_weight_avg": Moved(None, "Lightning 1.x; attach the StochasticWeightAveraging callback"),
    "amp_backend": Moved("mixed_precision", 'Lightning 1.x; torch autocast always: "bf16" or "fp16"'),
    "flush_logs_every_n_steps": Moved("log_every_n_steps", "Lightning 1.x"),
    "prepare_data_per_node": Moved(None, "prepare_data runs once, on global rank zero"),
    "model_registry": Moved(None, "not supported: upload checkpoints from run_dir yourself"),
}
"""Arguments of Lightning 1.x's `Trainer` (and later additions) that old code still passes: the error
for an unknown field names them too; the migration guide's table lists `TRAINER_ARGUMENTS`."""


def lightning_hint(name: str) -> str | None:
    """What to write instead of Lightning's `name`, or None when `name` is not one of its arguments."""
    moved = TRAINER_ARGUMENTS.get(name) or OLDER_TRAINER_ARGUMENTS.get(name)
    if moved is None:
        return None
    if moved.field is None:
        return f"{name!r} is Lightning's Trainer argument; here it is not a config field: {moved.note}"
    return f"{name!r} is Lightning's Trainer argument; here write {moved.field}= ({moved.note})"


def doc_row(name: str) -> str:
    """The row of docs/migrating-from-lightning.md's Trainer-argument table for `name`."""
    moved = TRAINER_ARGUMENTS[name]
    ours = f"`{moved.field}`" if moved.field else "—"
    return f"| `{name}` | {ours} | {moved.note} |"
