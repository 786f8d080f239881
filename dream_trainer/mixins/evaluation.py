"""EvaluationMixin: validation, test and prediction loops, and `validate()` / `test()` / `predict()`.

The three loops share one implementation: models in eval mode (restored after), gradients off,
batches on the device, steps under autocast, the stage's hooks, and the training RNG left exactly
as it was, so evaluating never changes training (or a resumed run); `config.val_restores_rng=False`
lets validation draw from it, as a plain loop's evaluation does.

It is the top layer: it runs the user's steps as `StepMixin` wrapped them, and sets the trainer up and
loads checkpoints (`CheckpointMixin`) on demand; see `dream_trainer.mixins.core` for the layers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple, overload

import torch

from dream_trainer.callbacks.bus import Hooks
from dream_trainer.errors import MisconfigurationError
from dream_trainer.mixins.checkpoint import CheckpointMixin
from dream_trainer.mixins.step import StepMixin
from dream_trainer.utils.data import (
    IndexRecorder,
    as_loader_list,
    limited_length,
    recording_indices,
    releasing,
    takes_dataloader_idx,
)
from dream_trainer.utils.numbers import format_metric
from dream_trainer.utils.seed import rng_state, set_rng_state
from dream_trainer.utils.step_outputs import EvalMetricNames
from dream_trainer.utils.tensors import batch_size_of, move_to_device

_NO_BATCH = object()  # an evaluation that ran no batch


class _LoopHooks(NamedTuple):
    """The hooks one evaluation loop fires, picked from the bus by name where the loop is entered
    (`validation_loop`, `test`, `predict`), and run by `_run_eval`."""

    start: Hooks
    epoch_start: Hooks
    batch_start: Hooks
    batch_end: Hooks
    epoch_end: Hooks
    end: Hooks


class EvaluationMixin(StepMixin, CheckpointMixin):
    """`validation_loop()` (used by `fit()`), and the stand-alone `validate()`, `test()`, `predict()`."""

    def _init_evaluation(self) -> None:
        # The dataset indices of the batch `predict()` is at (None outside predict, or when the loader
        # is not a plain DataLoader over a map-style dataset): what a prediction writer saves beside it.
        self.current_batch_indices: list[int] | None = None
        self._validation_metrics: dict[str, float] = {}  # the last validation's results (not the sanity check)
        self.sanity_checking: bool = False
        """True while the sanity check (a short validation before training) runs."""
        # Where `self.log` (LoggingMixin, which declares them) sends values while an evaluation runs.
        self._in_validation: bool = False
        self._eval_phase: str = "val"  # the torchmetrics phase of the running evaluation ("val" or "test")
        self._val_batch_size: int = 1
        self._val_ran_in_epoch: dict[str, float] = {}  # the results of a validation inside this epoch

    def _start_epoch_validations(self) -> None:
        """A training epoch opens: no validation has run in it yet (its summary line shows the last one)."""
        self._val_ran_in_epoch = {}

    @property
    def validation_metrics(self) -> dict[str, float]:
        """The results of the last validation (not the sanity check), as `validation_loop()` returned
        them: what a progress display prints when a validation ends. Empty before the first one."""
        return self._validation_metrics

    # --- what the user may write --------------------------------------------------------------------
    def test_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute test metrics of one batch; return a dict of scalars (used by `test()`)."""
        raise NotImplementedError

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """Compute the prediction for one batch (used by `predict()`, which returns them in a list)."""
        raise NotImplementedError

    def configure_test_dataloader(self) -> Iterable[Any] | None:
        """The loader (or a list of them) `test()` uses when it is given none and the trainer has no
        datamodule (a datamodule's `test_dataloader()` wins over this, as in Lightning). The default
        calls Lightning's `test_dataloader()` when the trainer defines it."""
        if self.datamodule is not None:
            self._setup_datamodule("test")
            return self.datamodule.test_dataloader()
        own = getattr(self, "test_dataloader", None)  # Lightning's hook, written on the trainer
        return own() if callable(own) else None

    def configure_predict_dataloader(self) -> Iterable[Any] | None:
        """The loader (or a list of them) `predict()` uses when it is given none and the trainer has no
        datamodule (a datamodule's `predict_dataloader()` wins over this, as in Lightning). The default
        calls Lightning's `predict_dataloader()` when the trainer defines it."""
        if self.datamodule is not None:
            self._setup_datamodule("predict")
            return self.datamodule.predict_dataloader()
        own = getattr(self, "predict_dataloader", None)  # Lightning's hook, written on the trainer
        return own() if callable(own) else None

    # --- fit's validation ---------------------------------------------------------------------------
    def _run_sanity_check(self) -> None:
        n = self.config.num_sanity_val_steps
        if self._val_loader_raw is None or n == 0:
            return
        # Callbacks see the sanity run's values while it lasts; they are not logged and are dropped
        # afterwards, so nothing downstream mistakes them for a real validation.
        before = dict(self._metrics)
        self.sanity_checking = True
        try:
            self._bus.fire("on_sanity_check_start")
            self.validation_loop()
            self._bus.fire("on_sanity_check_end")
        finally:
            self.sanity_checking = False
            self._metrics.clear()
            self._metrics.update(before)

    def validation_loop(self) -> dict[str, float]:
        """Run validation over the validation loader and return its metrics (batch-size-weighted
        means). Models are put in eval mode and restored after; gradients are off."""
        loader = self._val_loader_raw
        if loader is None:
            return {}
        loaders = [(dl, self._val_limit(dl)) for dl in as_loader_list(loader)]

        def publish(results: dict[str, float]) -> None:
            if self.sanity_checking:
                self._metrics.update(results)
                return
            self._loop.validated()
            self._validation_metrics = dict(results)
            self._emit(results, self._loop.global_step)
            if self._loop.epoch_in_progress:
                self._val_ran_in_epoch = results
            elif results and self.config.print_epoch_summary and self.is_global_zero:
                print("validation | " + " | ".join(f"{k} {format_metric(v)}" for k, v in results.items()), flush=True)

        bus = self._bus
        hooks = _LoopHooks(
            start=bus.on_validation_start,
            epoch_start=bus.on_validation_epoch_start,
            batch_start=bus.on_validation_batch_start,
            batch_end=bus.on_validation_batch_end,
            epoch_end=bus.on_validation_epoch_end,
            end=bus.on_validation_end,
        )
        takes_idx = len(loaders) > 1 and self._val_step_takes_idx
        return self._run_eval("validation", hooks, loaders, self.validation_step, publish, takes_idx)

    def _val_limit(self, loader: Iterable[Any]) -> int | None:
        """Batches of `loader` one validation runs: `limit_val_batches`; in the sanity check at most
        `num_sanity_val_steps` of those (-1: all of them), per loader, as Lightning counts them."""
        limit = limited_length(loader, self.config.limit_val_batches, "limit_val_batches")
        n = self.config.num_sanity_val_steps
        if not self.sanity_checking or n == -1:
            return limit
        return n if limit is None else min(n, limit)

    # --- stand-alone entry points -------------------------------------------------------------------
    def validate(
        self, dataloader: Iterable[Any] | None = None, ckpt_path: str | os.PathLike[str] | None = None
    ) -> dict[str, float]:
        """Run validation alone (sets the trainer up first; optionally loads `ckpt_path`, which may be
        "last") and return its metrics. Logged at the current `global_step`."""
        self._require_step("validation_step", "validate")
        with self._stage(ckpt_path, "validate"):
            if dataloader is not None:
                vals = [self._distribute_loader(dl, train=False) for dl in as_loader_list(dataloader)]
                self.val_loader = vals[0] if len(vals) == 1 else vals
            if self._val_loader_raw is None:
                raise MisconfigurationError(
                    f"{type(self).__name__}.validate() has no validation data: return a validation loader from "
                    "configure_dataloaders, or pass one: trainer.validate(dataloader)."
                )
            return self.validation_loop()

    def test(
        self, dataloader: Iterable[Any] | None = None, ckpt_path: str | os.PathLike[str] | None = None
    ) -> dict[str, float]:
        """Run `test_step` over `dataloader` (or `configure_test_dataloader()`) and return the metrics
        (batch-size-weighted means, plus `test*` torchmetrics), also logged and in `callback_metrics`."""
        self._require_step("test_step", "test")
        with self._stage(ckpt_path, "test"):
            loader = self._eval_loader(dataloader, "test")

            def publish(results: dict[str, float]) -> None:
                self._emit(results, self._loop.global_step)

            loaders = [(dl, limited_length(dl, self.config.limit_test_batches, "limit_test_batches")) for dl in loader]
            bus = self._bus
            hooks = _LoopHooks(
                start=bus.on_test_start,
                epoch_start=bus.on_test_epoch_start,
                batch_start=bus.on_test_batch_start,
                batch_end=bus.on_test_batch_end,
                epoch_end=bus.on_test_epoch_end,
                end=bus.on_test_end,
            )
            takes_idx = len(loaders) > 1 and takes_dataloader_idx(self.test_step)
            return self._run_eval("test", hooks, loaders, self._eval_call(self.test_step), publish, takes_idx)

    def predict(
        self, dataloader: Iterable[Any] | None = None, ckpt_path: str | os.PathLike[str] | None = None
    ) -> list[Any]:
        """Run `predict_step` over `dataloader` (or `configure_predict_dataloader()`) and return its
        outputs in order (with several processes: this rank's share)."""
        self._require_step("predict_step", "predict")
        with self._stage(ckpt_path, "predict"):
            loader = self._eval_loader(dataloader, "predict")
            # Each loader is rebuilt to record the dataset indices of its batches (`current_batch_indices`);
            # predict is not the training hot path, and a prediction writer needs them to say which sample
            # each prediction belongs to.
            recorded = [recording_indices(dl) for dl in loader]
            loaders = [
                (dl, limited_length(dl, self.config.limit_predict_batches, "limit_predict_batches"))
                for dl, _ in recorded
            ]
            bus = self._bus
            hooks = _LoopHooks(
                start=bus.on_predict_start,
                epoch_start=bus.on_predict_epoch_start,
                batch_start=bus.on_predict_batch_start,
                batch_end=bus.on_predict_batch_end,
                epoch_end=bus.on_predict_epoch_end,
                end=bus.on_predict_end,
            )
            takes_idx = len(loaders) > 1 and takes_dataloader_idx(self.predict_step)
            step = self._eval_call(self.predict_step)
            return self._run_eval("predict", hooks, loaders, step, None, takes_idx, [r for _, r in recorded])

    # --- shared machinery ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _stage(self, ckpt_path: str | os.PathLike[str] | None, entry: str) -> Iterator[None]:
        """Around `validate()`/`test()`/`predict()`: set up if `fit()` has not, `setup(entry)` ...
        `teardown(entry)` (as Lightning pairs them for each call), loggers attached, `ckpt_path` loaded;
        run.json records the evaluation, the checkpoint it read and how it ended."""
        inside_fit = "fit" in self._setup_stages  # a callback evaluating during fit(): fit owns the record
        outcome, checkpoint = "failed", None
        try:
            self._setup_fit(entry)
            self._enter_stage(entry)
            self._attach_loggers()
            if ckpt_path is not None:
                checkpoint = self.resolve_checkpoint(ckpt_path, entry)
                self.load_checkpoint(checkpoint)
            yield
            outcome = "success"
        except BaseException as exc:
            outcome = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            raise
        finally:
            try:
                self._leave_stage(entry)
                if not inside_fit:  # its own entry point: the loggers' runs end with it, as after fit()
                    self._flush_pending_logs()
                    self._finalize_loggers("success" if outcome == "success" else "failed")
            finally:
                self._record_evaluation(entry, checkpoint, outcome, inside_fit)

    def _require_step(self, method: str, entry: str) -> None:
        if getattr(type(self), method) is getattr(EvaluationMixin, method):
            raise MisconfigurationError(
                f"{type(self).__name__}.{entry}() needs a {method}: define `def {method}(self, batch, batch_idx):`"
            )

    def _eval_loader(self, given: Iterable[Any] | None, entry: Literal["test", "predict"]) -> list[Iterable[Any]]:
        """The loaders of `test()`/`predict()`: those given, else the datamodule's (which wins over an
        overridden `configure_*_dataloader`, as in Lightning), else `configure_*_dataloader()`."""
        loader = given
        if loader is None:
            dm = self.datamodule
            if dm is not None:
                self._setup_datamodule(entry)
                loader = dm.test_dataloader() if entry == "test" else dm.predict_dataloader()
            else:
                loader = self.configure_test_dataloader() if entry == "test" else self.configure_predict_dataloader()
        if loader is None:
            raise MisconfigurationError(
                f"{type(self).__name__}.{entry}() has no data: pass a loader, trainer.{entry}(dataloader), "
                f"or define configure_{entry}_dataloader(self)."
            )
        return [self._distribute_loader(dl, train=False) for dl in as_loader_list(loader)]

    def _eval_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        dtype = self._amp_dtype
        if dtype is None:
            return fn

        def under_autocast(batch: Any, batch_idx: int, *idx: int) -> Any:
            with torch.autocast(self.device.type, dtype=dtype):
                return fn(batch, batch_idx, *idx)

        return under_autocast

    @overload
    def _run_eval(
        self,
        stage: Literal["validation", "test"],
        hooks: _LoopHooks,
        loaders: list[tuple[Iterable[Any], int | None]],
        step: Callable[..., Any],
        publish: Callable[[dict[str, float]], None] | None,
        takes_idx: bool = False,
        recorders: list[IndexRecorder | None] | None = None,
    ) -> dict[str, float]: ...

    @overload
    def _run_eval(
        self,
        stage: Literal["predict"],
        hooks: _LoopHooks,
        loaders: list[tuple[Iterable[Any], int | None]],
        step: Callable[..., Any],
        publish: Callable[[dict[str, float]], None] | None,
        takes_idx: bool = False,
        recorders: list[IndexRecorder | None] | None = None,
    ) -> list[Any]: ...

    def _run_eval(
        self,
        stage: str,
        hooks: _LoopHooks,
        loaders: list[tuple[Iterable[Any], int | None]],
        step: Callable[..., Any],
        publish: Callable[[dict[str, float]], None] | None,
        takes_idx: bool = False,
        recorders: list[IndexRecorder | None] | None = None,
    ) -> dict[str, float] | list[Any]:
        """One pass of `stage` ("validation", "test", "predict") over each `(loader, limit)` in turn,
        firing the stage's `hooks`.

        With several loaders the metrics of loader i are named `<name>/dataloader_idx_<i>` (Lightning's
        scheme), the step gets `dataloader_idx` when it takes it (`takes_idx`), and `predict` returns one
        list of outputs per loader. `recorders` (predict): where each loader's batch indices are read, to
        set `current_batch_indices` before each batch."""
        phase = {"validation": "val", "test": "test"}.get(stage)
        heartbeat = self._heartbeat
        several = len(loaders) > 1
        predictions: list[Any] = []
        results: dict[str, float] = {}
        last: Any = _NO_BATCH  # the last step's outputs: what to name when nothing was logged
        with self._evaluating(stage, phase) as naming:
            for fn in hooks.start:
                fn()
            for fn in hooks.epoch_start:
                fn()
            # Set once per loop: a step that calls `self.training_step` gets the user's method (no backward).
            with torch.no_grad(), self._steps_as_written():
                for dl_idx, (loader, limit) in enumerate(loaders):
                    recorder = recorders[dl_idx] if recorders is not None else None
                    kept, ran = self._eval_batches(
                        stage, hooks, step, takes_idx, naming, dl_idx, loader, limit, recorder
                    )
                    last = ran if ran is not _NO_BATCH else last
                    if phase is None:
                        if several:
                            predictions.append(kept)
                        else:
                            predictions = kept
                    elif several:
                        results.update(self._loader_results(phase, dl_idx))
                heartbeat.mark(f"on_{stage}_epoch_end")
                for fn in hooks.epoch_end:
                    fn()
            if naming is not None:
                results = self._eval_results(stage, naming, results if several else None, last)
                if publish is not None:
                    publish(results)
        heartbeat.mark(f"on_{stage}_end")
        for fn in hooks.end:
            fn()
        return predictions if phase is None else results

    @contextlib.contextmanager
    def _evaluating(self, stage: str, phase: str | None) -> Iterator[EvalMetricNames | None]:
        """Around one `_run_eval`: the models in eval mode, `self.log` sending values to the evaluation of
        `phase` (None: predict), its metrics reset; afterwards the models' modes and the training RNG as
        they were. Yields how the step's outputs are named (None for predict, which keeps them instead)."""
        models = [m for _, m in self.named_models()]
        was_training = [m.training for m in models]
        # Evaluation must not move the training RNG (iterating a loader draws a seed, dropout in a
        # frozen submodule, ...): otherwise validating, or skipping a validation on resume, would
        # change training. Lightning isolates its sanity check the same way. `val_restores_rng=False`
        # lets a validation (not the sanity check) draw from it, as a plain loop's evaluation does.
        shares_rng = stage == "validation" and not self.sanity_checking and not self.config.val_restores_rng
        rng_before = None if shares_rng else rng_state()
        for m in models:
            m.eval()
        self._in_validation = phase is not None
        self._eval_phase = phase or "val"
        self._val_metrics.reset()
        naming = None
        if phase:
            self._reset_metrics(phase)
            # What the step returns is named for the phase: its loss `val_loss`/`test_loss`, and no entry
            # under a training metric's name (see `EvalMetricNames`).
            naming = self._eval_metric_names(phase)
        try:
            yield naming
        finally:
            self._in_validation = False
            self.current_batch_indices = None
            for m, mode in zip(models, was_training, strict=True):
                m.train(mode)
            if rng_before is not None:
                set_rng_state(rng_before)

    def _eval_batches(
        self,
        stage: str,
        hooks: _LoopHooks,
        step: Callable[..., Any],
        takes_idx: bool,
        naming: EvalMetricNames | None,
        dl_idx: int,
        loader: Iterable[Any],
        limit: int | None,
        recorder: IndexRecorder | None,
    ) -> tuple[list[Any], Any]:
        """The batches of loader `dl_idx` of a `_run_eval` (`limit` of them, None: all): each on the device, the
        step run between the batch hooks, what it returns named into the metrics by `naming`, or kept (predict:
        `naming` None). Returns what was kept and the last step's outputs (`_NO_BATCH`: the loader had none)."""
        batch_start, batch_end = hooks.batch_start, hooks.batch_end
        heartbeat, step_name, fetching = self._heartbeat, f"{stage}_step", f"fetching a {stage} batch"
        kept: list[Any] = []
        outputs: Any = _NO_BATCH
        batches: Any = iter(loader)
        source = batches
        if limit is not None:
            batches = itertools.islice(batches, limit)
        heartbeat.mark(fetching)
        for batch_idx, batch in releasing(source, enumerate(batches)):
            heartbeat.mark(step_name)
            if self._move_batches:
                batch = move_to_device(batch, self.device, self._non_blocking)
            self._val_batch_size = batch_size_of(batch)
            if recorder is not None:
                self.current_batch_indices = recorder.seen[batch_idx]
            for fn in batch_start:
                fn(batch, batch_idx)
            outputs = step(batch, batch_idx, dl_idx) if takes_idx else step(batch, batch_idx)
            if naming is None:
                kept.append(outputs)
            elif outputs is not None and (named := naming.metrics(outputs)) is not None:
                self._val_metrics.update(named, float(self._val_batch_size))
            for fn in batch_end:
                fn(outputs, batch, batch_idx)
            heartbeat.mark(fetching)
        return kept, outputs

    def _eval_results(
        self, stage: str, naming: EvalMetricNames, per_loader: dict[str, float] | None, last: Any
    ) -> dict[str, float]:
        """The results of a validation or test whose batches all ran: `per_loader` (several loaders: each
        one's, already named), else the means of the one loader and the torchmetrics it updated; what is
        said about them (nothing logged, a training metric's name) said."""
        self._heartbeat.mark(f"reducing the {stage} metrics")
        if per_loader is None:
            results = self._val_metrics.totals()  # SYNC: once per run
            results.update(self._compute_metrics(naming.phase))
        else:
            results = per_loader
        self._val_metrics.reset()
        if not results and last is not _NO_BATCH:
            self._note_nothing_logged(stage, last)
        if not self.sanity_checking:  # the sanity check's values are not logged
            self._note_eval_results(results, naming.phase, naming.training)
        return results

    def _loader_results(self, phase: str, dl_idx: int) -> dict[str, float]:
        """The metrics of loader `dl_idx` of several, named `<name>/dataloader_idx_<i>`: the step's means
        and the torchmetrics it updated (then reset, so the next loader starts afresh). SYNC: once per
        loader. A name logged with `prog_bar=True` or `logger=False` keeps that option under its new name."""
        part = self._val_metrics.totals()
        part.update(self._compute_metrics(phase))
        self._val_metrics.reset()
        self._reset_metrics(phase)
        suffixed = {f"{k}/dataloader_idx_{dl_idx}": v for k, v in part.items()}
        for name, new in zip(part, suffixed, strict=True):
            self._note_display_options(new, name in self._prog_bar, name not in self._unlogged)
        return suffixed
