"""`DataModule`: the data of a run in one object, as Lightning's `LightningDataModule`.

A trainer given one (`MyTrainer(config, datamodule=dm)` or `trainer.fit(datamodule=dm)`) takes its
loaders from it instead of `configure_dataloaders`: `train_dataloader()` and `val_dataloader()` for
`fit()` and `validate()`, `test_dataloader()` for `test()`, `predict_dataloader()` for `predict()`.
A Lightning DataModule ports by changing its base class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dream_trainer.protocol import TrainerProtocol


class AttributeDict(dict[str, Any]):
    """A dict whose keys read as attributes too (`dm.hparams.batch_size`), as Lightning's `hparams`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r}; it holds {sorted(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class DataModule:
    """Prepares, splits and serves the data of a run. Override what you need; every method is optional.

    Order: `prepare_data()` once on global rank zero (download, tokenize: work that writes files), then
    `setup(stage)` on every process (build datasets, split), then the loaders; `teardown("fit")` at the
    end of `fit()`. `stage` is "fit" when the trainer is set up (by `fit()`, or by `validate()`, which
    takes the validation loader from the same setup), "test" before `test()` and "predict" before
    `predict()` first ask for their loaders; each stage is set up once. `state_dict()` goes into the
    trainer's checkpoints and `load_state_dict()` gets it back on resume (e.g. a curriculum's position).

    `setup` and `teardown` may be written without the `stage` argument. Any loader method may return a
    list of loaders (several validation, test or predict loaders; see the guide).
    """

    trainer: TrainerProtocol | None = None
    """The trainer using this DataModule (set before `prepare_data`), as in Lightning: read
    `self.trainer.world_size`, `current_epoch`, ... from the loader methods. None until then."""

    @property
    def hparams(self) -> AttributeDict:
        """What `save_hyperparameters()` recorded (empty until it is called)."""
        found = self.__dict__.get("_hparams")
        if found is None:  # subclasses need not call DataModule.__init__ (there is none), as in Lightning
            found = self.__dict__["_hparams"] = AttributeDict()
        return found

    def save_hyperparameters(self, *names: str, ignore: str | Iterable[str] = ()) -> None:
        """Record the arguments of the calling `__init__` in `self.hparams` (all of them, or `names`),
        leaving out `ignore`. Lightning's method, for DataModules that call it."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:  # an interpreter without frame support: nothing to read
            return
        try:
            info = inspect.getargvalues(caller)
        finally:
            del frame, caller  # a frame kept in a local would keep every local of the caller alive
        values = {n: info.locals[n] for n in info.args if n != "self" and n in info.locals}
        if info.keywords:
            values.update(info.locals.get(info.keywords, {}))
        skip = {ignore} if isinstance(ignore, str) else set(ignore)
        chosen = names or tuple(values)
        self.__dict__["_hparams"] = AttributeDict({n: values[n] for n in chosen if n in values and n not in skip})

    def prepare_data(self) -> None:
        """Once per run, on global rank zero only, before `setup`: download or write files here."""

    def setup(self, stage: str) -> None:
        """On every process, before the loaders of `stage` are asked for: build the datasets here."""

    def train_dataloader(self) -> Iterable[Any] | None:
        """The training loader (needed by `fit()`)."""
        return None

    def val_dataloader(self) -> Iterable[Any] | None:
        """The validation loader (or a list of them), or None."""
        return None

    def test_dataloader(self) -> Iterable[Any] | None:
        """The loader (or a list of them) `test()` uses, or None."""
        return None

    def predict_dataloader(self) -> Iterable[Any] | None:
        """The loader (or a list of them) `predict()` uses, or None."""
        return None

    def teardown(self, stage: str) -> None:
        """At the end of `fit()` (stage "fit"): close files, free memory."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this DataModule (default: nothing)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict()` returned."""


def call_stage_hook(hook: Callable[..., Any], stage: str) -> None:
    """`hook(stage)` for `setup`/`teardown`, or `hook()` when the user wrote it without `stage` (called a
    few times per run, so the signature is read at each call)."""
    try:
        takes_stage = bool(inspect.signature(hook).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin): pass the stage
        takes_stage = True
    if takes_stage:
        hook(stage)
    else:
        hook()
