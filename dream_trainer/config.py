"""`DreamTrainerConfig`: the settings of a run, validated when the config is built."""

from __future__ import annotations

import os
import weakref
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from dream_trainer.config_checks import (  # noqa: F401 (the choices, importable from here as before)
    ACTIVATION_CHECKPOINTING,
    CLIP_ALGORITHMS,
    INIT_DEVICES,
    MIXED_PRECISION_CHOICES,
    NON_FINITE_LOSS_POLICIES,
    NON_FINITE_POLICIES,
    PIPELINE_SCHEDULES,
    REQUEUE_SIGNALS,
    SPIKE_POLICIES,
    field_rules,
)
from dream_trainer.errors import ConfigError
from dream_trainer.fault_tolerance import FaultToleranceConfig, as_fault_tolerance
from dream_trainer.mirror.setting import MirrorConfig, as_mirror
from dream_trainer.parallel import STRATEGIES as _STRATEGY_CLASSES
from dream_trainer.utils.annotations import FieldCheck, field_checks, short_repr

if TYPE_CHECKING:
    from dream_trainer.callbacks.base import Callback
    from dream_trainer.loggers.base import Logger

STRATEGIES = ("auto", *_STRATEGY_CLASSES)
_FIELD_RULES = field_rules(STRATEGIES)
# Per config class: the checks of the fields it adds to DreamTrainerConfig, from their annotations.
_ADDED_FIELD_CHECKS: weakref.WeakKeyDictionary[type, tuple[FieldCheck, ...]] = weakref.WeakKeyDictionary()


@dataclass
class DreamTrainerConfig:
    """Settings of a training run. Subclass it (as a dataclass) to add your own fields.

    Every field is checked when the config is built; a bad value raises `ConfigError` naming the
    field, the value and what is valid, before any model is built.
    """

    # --- reproducibility ---
    seed: int | None = 42
    """Seeds Python, NumPy and torch at the start of `fit()`. None leaves the RNGs alone."""

    # --- how long ---
    n_epochs: int | None = None
    """Epochs to train. None (the default): no epoch limit when `max_steps` is set (training runs
    `max_steps` steps, as Lightning's `max_epochs`), else 1, which the config then holds. When both are
    set, whichever is reached first ends training."""
    max_steps: int | None = None
    """Stop after this many training steps (accumulation windows). None: no step limit."""
    limit_train_batches: int | float | None = None
    """Batches per training epoch: an int counts batches, a float in (0, 1] is a fraction. None: all."""
    limit_val_batches: int | float | None = None
    """Batches per validation run, as `limit_train_batches`. 0 turns validation off."""
    limit_test_batches: int | float | None = None
    """Batches `test()` runs, as `limit_train_batches`."""
    limit_predict_batches: int | float | None = None
    """Batches `predict()` runs, as `limit_train_batches`."""
    fast_dev_run: bool | int = False
    """A smoke test of the whole trainer: True (1) or n runs n batches of training, validation, test and
    predict, one epoch, no sanity check, no loggers, no checkpoints; the run directory is a temporary one,
    deleted afterwards. Sets the limits, `n_epochs`, `num_sanity_val_steps`, `loggers` and
    `enable_checkpointing` when the config is built."""
    overfit_batches: int | float = 0
    """Train on the first n batches (or fraction) of the training loader, read in order, every epoch,
    and validate on the same batches: a model that cannot overfit them has a bug. 0: off."""
    reload_dataloaders_every_n_epochs: int = 0
    """Call `configure_dataloaders()` (or the datamodule's `train_dataloader()`/`val_dataloader()`) again
    before every n-th epoch, e.g. for a curriculum that changes the data. 0: once, at setup."""

    # --- debugging ---
    deterministic: bool | str = False
    """True: `torch.use_deterministic_algorithms(True)` (an op without a deterministic kernel raises),
    cuDNN deterministic and not benchmarking, `CUBLAS_WORKSPACE_CONFIG` set; "warn": the same, but such
    ops only warn. Set when `fit()` (or `validate`, ...) sets the trainer up; it is process-wide."""
    detect_anomaly: bool = False
    """Run training under `torch.autograd.detect_anomaly()`: the backward that produced a NaN raises,
    naming the forward op. Slow: for debugging only."""

    # --- validation cadence ---
    val_every_n_epochs: int | None = 1
    """Validate at the end of every n-th epoch. None: never at epoch ends."""
    val_every_n_steps: int | None = None
    """Also validate every n training steps. None: only at epoch ends."""
    val_at_start: bool = False
    """Also validate once before the first training step, logged at step 0 like every validation (a
    plain loop's evaluation at iteration 0); a run resumed after step 0 does not repeat it. Unlike the
    sanity check, its metrics reach the loggers and `callback_metrics`."""
    val_restores_rng: bool = True
    """Validation leaves the global RNG (Python, NumPy, torch) as it found it, so validating or not
    trains the same weights. False: validation draws from the training RNG, as in a plain loop whose
    evaluation samples batches or runs dropout (the sanity check, `test()` and `predict()` still restore it)."""
    num_sanity_val_steps: int = 2
    """Validation batches run before training to catch bugs early, per validation loader and at most
    `limit_val_batches`. 0 skips it, -1 runs all (Lightning's meaning)."""

    # --- optimization ---
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Losses are averaged over each window."""
    gradient_clip_val: float | None = None
    """Clip gradients at every optimizer step (max norm, or max value). None: no clipping."""
    gradient_clip_algorithm: str = "norm"
    """How `gradient_clip_val` clips: "norm" (total L2 norm) or "value" (each element)."""
    scheduler_interval: str = "epoch"
    """When LR schedulers step: "epoch" (after each epoch) or "step" (after each optimizer step)."""
    scheduler_monitor: str = "val_loss"
    """Metric passed to `ReduceLROnPlateau.step()`; must be in `trainer.callback_metrics`."""
    non_finite_grads: str = "ignore"
    """NaN/inf gradients, checked at every optimizer step (one sync each): "ignore" (no per-step check;
    `non_finite_loss` still watches the logged loss), "raise", "skip" the step, or "retry" the batch."""
    max_non_finite_retries: int = 3
    """With non_finite_grads="retry": how often one batch is re-run before the run fails."""
    non_finite_loss: str = "raise"
    """A NaN/inf training loss, found where the logged values are read anyway (each logging point; no
    extra sync): "raise" stops the run naming the steps, "warn" says so once and trains on, "ignore"
    turns the check off. Checkpoints with non-finite weights never become `last.ckpt` in any case."""
    spike_policy: str = "off"
    """Loss spikes (docs/bad-batches.md): each batch's training loss is compared with the last
    `spike_window` ones; a NaN/inf loss or one above mean + `spike_threshold` x std is a spike. "off";
    "warn" (recorded, trains on; read at logging points: no sync); "skip" the optimizer step (one device
    sync per step); "rollback" to the in-memory snapshot of every `spike_snapshot_every` steps, then
    train on without the bad batch (read every `spike_snapshot_every` steps). With several processes,
    "skip"/"rollback" need strategy="ddp" (the ranks agree with one all-reduce of one integer where they
    read). Every skipped batch (and its sample indices) is listed in `trainer.skipped_batches`,
    checkpoints, run.json."""
    spike_threshold: float = 6.0
    """A spike: loss > mean + spike_threshold x std of the last `spike_window` losses (the std is taken
    as at least 1% of the mean: a flat loss does not make every wiggle a spike)."""
    spike_window: int = 50
    """How many recent losses (spikes left out) the statistic covers."""
    spike_warmup: int = 5
    """Losses seen before the threshold applies (NaN/inf losses are spikes from the first batch)."""
    spike_snapshot_every: int = 10
    """spike_policy="rollback": steps between in-memory snapshots (the batches since the last one are
    kept in memory to train on again after a rollback)."""
    skip_batches: Any = None
    """Batches the training loader fetches and drops without a step: `[[epoch, batch_idx], ...]`, or the
    path of a JSON file holding such a list or a run.json (its "skipped_batches"). None: none."""

    # --- precision and compilation ---
    mixed_precision: str | None = None
    """None (fp32), "bf16" or "fp16" autocast. fp16 adds a loss scaler shared by all optimizers."""
    compile_model: bool = False
    """`torch.compile` every model with trainable parameters before optimizers are built."""

    # --- where ---
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N" or "mps"."""
    strategy: str = "auto"
    """Multi-process strategy: "auto" (DDP when launched on several processes; "model_parallel" when a
    degree below other than dp_shard is set), "single", "ddp", "fsdp" (FSDP2) or "model_parallel"
    (the N-D mesh of the degrees below)."""
    dp_replicate: int = 1
    """Data-parallel replicas (the model is copied; with dp_shard > 1 too: HSDP)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2 over this many ranks); -1: the ranks the other degrees leave."""
    tensor_parallel: int = 1
    """Tensor-parallel degree; > 1 needs `apply_tensor_parallel(self, tp_mesh)` on the trainer."""
    pipeline_parallel: int = 1
    """Pipeline-parallel stages; > 1 needs an `nn.Sequential` model or `apply_pipeline_parallel`."""
    context_parallel: int = 1
    """Context-parallel degree (sequence sharding for attention; CUDA only)."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule: "gpipe", "1f1b" or "interleaved_1f1b" (several stages per rank)."""
    pipeline_microbatches: int | None = None
    """Micro-batches a batch is split into under pipeline parallelism; None: the number of stages."""
    init_device: str | None = None
    """"meta": `configure_models` builds on the meta device (no memory), parallelism is applied, then
    parameters are allocated on the device and `init_weights()` runs. None: build where you like."""
    activation_checkpointing: str | None = None
    """Recompute activations in backward, per top-level block: None, "full" or "selective" (keeps
    matmul outputs)."""
    float8: bool = False
    """float8 matmuls in Linear layers (torchao; CUDA with compute capability >= 8.9)."""
    find_unused_parameters: bool = False
    """DDP: allow parameters that get no gradient in a step (slower; needed for some GAN/branching models)."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep parameters and gradients on the CPU between uses."""
    fsdp_sharded_checkpoints: bool = True
    """FSDP: write sharded DCP checkpoints (a directory, every rank writes its shards); False gathers
    the full state to rank zero and writes one file."""
    process_group_timeout: float = 1800.0
    """Seconds a collective may wait for the other ranks before the run fails (a dead rank is reported)."""
    hang_timeout: float | None = 600.0
    """Several processes: seconds a rank may make no progress (no step, hook, validation batch or
    checkpoint starts) before the hang watchdog names the stuck rank and where it is, writes its Python
    stacks to the run directory, records "hung" in run.json and ends the job (exit code 124). Keep it
    above the longest step, validation batch or checkpoint save; at most `process_group_timeout` (a
    longer one is refused when the config is built: a collective would time out first, naming no rank).
    None: not watched. See docs/unattended.md."""
    hang_timeout_first_step: float | None = None
    """`hang_timeout` until the first training step of a fit completes (setup, checkpoint load, sanity
    check, compilation, warm-up); None: 3 x `hang_timeout`, at most `process_group_timeout` (a longer
    value is refused, as for `hang_timeout`)."""
    root_dir: str = "runs"
    """Directory of the runs: each run writes only into its own `<root_dir>/<run name>/` (checkpoints,
    logs, config copy), `trainer.run_dir`. A local (or shared) directory; for an object store, see `mirror`."""
    mirror: MirrorConfig | None = None
    """A copy of each run directory in an object store: a URL ("s3://bucket/runs"; `pip install
    "dream-trainer[s3]"`), or a `MirrorConfig` (or a dict of its fields). Checkpoints are uploaded in the
    background, each visible only once complete (a commit marker written last); run.json and the loggers'
    files follow; `fit(ckpt_path="last")` with an empty `root_dir` continues from the store. None (the
    default): off. See docs/object-store.md."""

    # --- checkpoints and interruption ---
    resume_from: str | None = None
    """Checkpoint `fit()` resumes from when called without `ckpt_path`: a path (a new run starts from
    it), or "last": the newest run under `root_dir` (of `run_name`, when set) continues from its newest
    valid checkpoint, in its own directory; with none, a new run starts from scratch."""
    async_checkpointing: bool = False
    """Copy the state to the CPU in the step and write checkpoint files in a background thread (which
    also copies the optimizers' per-parameter state; the next optimizer step waits for that copy)."""
    checkpoint_crc32: bool = True
    """Write zip CRC-32 checksums into checkpoint files (torch computes them as it writes:
    one more pass over the data). False leaves them out: torch.load never checks them, but zip tools and
    pickle scanners then reject the files."""
    handle_signals: bool = True
    """On SIGTERM/SIGINT finish the current batch, save a checkpoint, and exit with 128+signal."""
    requeue_signal: str | None = "SIGUSR1"
    """In a SLURM job (with `handle_signals`): the signal that saves a checkpoint as SIGTERM does, then
    requeues the job (`scontrol requeue`; submit with `sbatch --requeue --signal=USR1@120`): "SIGUSR1",
    "SIGUSR2", "SIGTERM" (for `--signal=TERM@120`; `scancel`'s SIGTERM still cancels: a job no longer
    RUNNING is never requeued), or None: no requeue (SIGUSR1 keeps its default action). See
    docs/unattended.md."""

    run_name: str | None = None
    """Name of the run directory `<root_dir>/<run_name>` (taken: `<run_name>-v1`, `-v2`, ...); None: the
    next free `version_N`. `fit(ckpt_path="last")` continues the newest run of that name."""

    # --- what is shown and logged ---
    log_every_n_steps: int = 50
    """Reduce and write training metrics every n steps (one device sync per write)."""
    loggers: list[Logger] | None = None
    """Metric loggers; None: a TensorBoardLogger. [] logs nowhere."""
    enable_progress_bar: bool = True
    """Show progress: a rich bar in a terminal, plain periodic lines otherwise (rank zero)."""
    print_epoch_summary: bool = True
    """Print one line per epoch (rank zero) with the epoch's mean metrics."""
    enable_checkpointing: bool = True
    """Add a `ModelCheckpoint(save_last=True)` (every epoch) unless one is attached."""
    callbacks: list[Callback] = field(default_factory=list)
    """Callbacks attached to the trainer, in dispatch order."""

    # --- fault tolerance across replica groups ---
    fault_tolerance: FaultToleranceConfig | None = None
    """Per-step fault tolerance across replica groups (torchft, `pip install "dream-trainer[ft]"`): a
    `FaultToleranceConfig` (or a dict of its fields). Groups that die or stall are left out of the next
    step; a (re)started group heals from a live one. None (the default): off. See docs/fault-tolerance.md."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Before the dataclass __init__: an unknown keyword would be a bare TypeError there.
        if kwargs:
            known = {f.name for f in fields(cls) if f.init}
            unknown = [k for k in kwargs if k not in known]
            if unknown:
                raise ConfigError(_unknown_fields_message(cls, unknown, known))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._apply_debug_runs()
        self.validate()

    def _apply_debug_runs(self) -> None:
        """`fast_dev_run` and `overfit_batches` are shorthands: they set the fields they imply."""
        name = type(self).__name__
        fdr = self.fast_dev_run
        if isinstance(fdr, bool) or fdr is None:
            n = 1 if fdr else 0
        elif isinstance(fdr, int) and fdr > 0:
            n = fdr
        else:
            raise ConfigError(f"{name}.fast_dev_run = {fdr!r} is invalid: expected True, False or a positive int.")
        if n:
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.n_epochs, self.max_steps = 1, None
            self.val_every_n_epochs, self.val_every_n_steps = 1, None
            self.num_sanity_val_steps = 0
            self.loggers = []
            self.enable_checkpointing = False
        over = self.overfit_batches
        ok = (isinstance(over, int) and not isinstance(over, bool) and over >= 0) or (
            isinstance(over, float) and 0.0 < over <= 1.0
        )
        if not ok:
            raise ConfigError(
                f"{name}.overfit_batches = {over!r} is invalid: expected 0 (off), an int of batches or a "
                "float in (0.0, 1.0]."
            )
        if over and not n:
            self.limit_train_batches = self.limit_val_batches = over

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field; raise `ConfigError` on the first bad one. Called on construction. The rules of
        single fields are a table (`dream_trainer.config_checks.field_rules`); those across fields follow."""
        name = type(self).__name__

        def bad(field_name: str, value: Any, valid: str) -> ConfigError:
            return ConfigError(f"{name}.{field_name} = {value!r} is invalid: {valid}.")

        rules = _FIELD_RULES
        for field_name, rule in rules:
            value = getattr(self, field_name)
            problem = rule(value)
            if problem is not None:
                raise bad(field_name, value, problem)
        if self.n_epochs is None and self.max_steps is None:
            self.n_epochs = 1  # neither limit given: one epoch (with max_steps alone, no epoch limit)
        if self.non_finite_grads == "retry" and self.gradient_accumulation_steps != 1:
            raise ConfigError(
                f"{name}.non_finite_grads = 'retry' needs gradient_accumulation_steps = 1 (got "
                f"{self.gradient_accumulation_steps}): a retry re-runs one batch, but the bad gradient may "
                "come from any micro-batch of the window. Use non_finite_grads='skip' with accumulation."
            )
        if self.hang_timeout is not None and self.hang_timeout > self.process_group_timeout:
            raise ConfigError(
                f"{name}.hang_timeout = {self.hang_timeout!r} is longer than process_group_timeout = "
                f"{self.process_group_timeout!r}: a collective waiting for a stuck rank would fail first, naming no "
                f"rank. Set hang_timeout at most {self.process_group_timeout:g} (None: not watched), or "
                f"process_group_timeout at least {self.hang_timeout:g}."
            )
        first = self.hang_timeout_first_step
        if first is not None and first > self.process_group_timeout:
            raise ConfigError(
                f"{name}.hang_timeout_first_step = {first!r} is longer than process_group_timeout = "
                f"{self.process_group_timeout!r}: a collective of the first step (or of setup) waiting for a stuck "
                f"rank would fail first, naming no rank. Set hang_timeout_first_step at most "
                f"{self.process_group_timeout:g} (None: 3 x hang_timeout, capped there), or process_group_timeout "
                f"at least {first:g}."
            )
        beyond_dp = [
            f"{f}={getattr(self, f)}"
            for f in ("dp_replicate", "tensor_parallel", "pipeline_parallel", "context_parallel")
            if getattr(self, f) != 1
        ]
        if beyond_dp and self.strategy in ("single", "ddp"):
            valid = f"{', '.join(beyond_dp)} needs a device mesh: use strategy='auto' or 'model_parallel'"
            raise bad("strategy", self.strategy, valid)
        self._validate_fault_tolerance(name)
        self._validate_mirror(name)
        self._validate_callbacks_and_loggers(bad)
        self._validate_added_fields()

    def _validate_mirror(self, name: str) -> None:
        if isinstance(self.root_dir, str) and "://" in self.root_dir:
            raise ConfigError(
                f"{name}.root_dir = {self.root_dir!r} is a URL: root_dir is the local directory the run writes; "
                f"to keep the run in {self.root_dir.split('://')[0]}:// set mirror={self.root_dir!r} and root_dir "
                "to a local directory (docs/object-store.md)."
            )
        self.mirror = as_mirror(self.mirror)

    # Settings fault tolerance refuses, each with what to use instead (see docs/fault-tolerance.md).
    def _validate_fault_tolerance(self, name: str) -> None:
        self.fault_tolerance = as_fault_tolerance(self.fault_tolerance)
        if self.fault_tolerance is None:
            return
        refusals = [
            ("strategy", self.strategy not in ("auto", "single", "ddp"), "use strategy='auto', 'single' or 'ddp'"),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps != 1,
                "use 1 (each step's quorum deals out one global batch; raise the batch size instead)",
            ),
            ("non_finite_grads", self.non_finite_grads == "retry", "use 'ignore', 'skip' or 'error'"),
            (
                "spike_policy",
                self.spike_policy in ("skip", "rollback"),
                "use 'off' or 'warn' (a dropped or rolled-back step is decided by the quorum under fault tolerance)",
            ),
            ("limit_train_batches", self.limit_train_batches is not None, "use None (max_steps bounds a run)"),
        ]
        for field_name, refused, instead in refusals:
            if refused:
                value = getattr(self, field_name)
                raise ConfigError(f"{name}.{field_name} = {value!r} is not supported with fault_tolerance: {instead}.")

    def _validate_added_fields(self) -> None:
        """The fields a subclass adds, against their annotations (read once per class)."""
        cls = type(self)
        checks = _ADDED_FIELD_CHECKS.get(cls)
        if checks is None:
            own = {f.name for f in fields(DreamTrainerConfig)}
            checks = _ADDED_FIELD_CHECKS[cls] = field_checks(cls, skip=own) if cls is not DreamTrainerConfig else ()
        for check in checks:
            value = getattr(self, check.name)
            problem = check.problem(value)
            if problem is not None:
                raise ConfigError(f"{cls.__name__}.{check.name} = {short_repr(value)} is invalid: {problem}.")

    def _validate_callbacks_and_loggers(self, bad: Any) -> None:
        from dream_trainer.callbacks.base import Callback
        from dream_trainer.callbacks.bus import CallbackList
        from dream_trainer.loggers.base import Logger

        if not isinstance(self.callbacks, (list, tuple)):
            raise bad("callbacks", self.callbacks, "expected a list of Callback instances")
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise bad(
                    "callbacks", self.callbacks, f"{type(cb).__qualname__} is not a dream_trainer Callback subclass"
                )
        # CallbackList checks each callback's type and hook names (typos fail here, at attach time).
        self.callbacks = CallbackList(self.callbacks)
        if self.loggers is None:
            return
        if not isinstance(self.loggers, (list, tuple)):
            raise bad("loggers", self.loggers, "expected None (TensorBoard) or a list of Logger instances")
        for lg in self.loggers:
            if not isinstance(lg, Logger):
                raise bad("loggers", self.loggers, f"{type(lg).__qualname__} is not a dream_trainer Logger")
        self.loggers = list(self.loggers)

    # ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (callbacks and loggers as class names), for logs and checkpoints."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("callbacks", "loggers"):
                v = None if v is None else [type(x).__qualname__ for x in v]
            elif isinstance(v, (FaultToleranceConfig, MirrorConfig)):
                v = asdict(v)
            elif isinstance(v, os.PathLike):
                v = os.fspath(v)
            out[f.name] = v
        return out

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Configs are plain data: let `torch.load(weights_only=True)` rebuild them (the Trainer Guide saves
        # `"config": self.config` in a checkpoint and loads it with a bare `torch.load`).
        super().__init_subclass__(**kwargs)
        torch.serialization.add_safe_globals([cls])

    def __getstate__(self) -> dict[str, Any]:
        # Callbacks and loggers are live objects (open files, lambdas), not configuration values:
        # they are not pickled, so a saved config loads anywhere with weights_only=True.
        state = dict(self.__dict__)
        state["callbacks"] = []
        state["loggers"] = None if state.get("loggers") is None else []
        return {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in state.items()}


def _unknown_fields_message(cls: type, unknown: list[str], known: set[str]) -> str:
    """One sentence per unknown field: Lightning's name mapped, else the closest field."""
    import difflib

    from dream_trainer.lightning.trainer_args import lightning_hint

    parts = []
    for name in unknown:
        hint = lightning_hint(name)
        if hint is None:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}" if close else "it is not a field of this config"
        parts.append(f"{name!r}: {hint}")
    tail = "Subclass the config (as a @dataclass) to add your own fields."
    line = f"{cls.__name__} got unknown field(s): " + "; ".join(parts) + ". " + tail
    if len(line) <= 300:
        return line
    # Too long for one line: the names first, then each field's hint on a line below.
    names = ", ".join(repr(n) for n in unknown)
    head = f"{cls.__name__} got {len(unknown)} unknown field(s): {names}; what to write instead is below. {tail}"
    if len(head) > 300:
        head = f"{cls.__name__} got {len(unknown)} unknown fields; what to write instead is below. {tail}"
    return head + "".join(f"\n  {part}" for part in parts)


torch.serialization.add_safe_globals([DreamTrainerConfig, FaultToleranceConfig, MirrorConfig])
