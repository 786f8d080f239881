"""Lightning's names and where each went here, as tables the code and the docs share (Lightning's
`Trainer` arguments -> config fields are in `lightning/trainer_args.py`):

- `MODULE_NAMES`: every public method, hook and property of Lightning's `LightningModule` (those of
  `torch.nn.Module` aside) -> what a `DreamTrainer` subclass writes or calls instead.
- `CALLBACK_NAMES`: every hook of Lightning's `Callback` -> the `dream_trainer.Callback` hook.

docs/tools/lightning_tables.py writes the last two into the migration guide; tests/test_lightning_names.py
checks that they list every name the installed Lightning defines and that every target exists.
"""

from __future__ import annotations

from typing import NamedTuple

from dream_trainer.callbacks.base import HOOKS


class Ours(NamedTuple):
    """Where a `LightningModule` or `Callback` name is here: `target`, or None (not supported), and a
    one-line `note` (Markdown: code in backticks) saying how it differs, or what to write instead.

    `target` is written as:

    - `name`: in `MODULE_NAMES`, an attribute of every `DreamTrainer` (a method, a property, a hook, or
      an attribute its `__init__` sets); in `CALLBACK_NAMES`, an attribute of `dream_trainer.Callback`;
    - `config.name`: a `DreamTrainerConfig` field;
    - `callbacks.Name`: a class of `dream_trainer.callbacks`;
    - `DataModule.name`: a method of `dream_trainer.DataModule`.
    """

    target: str | None
    note: str


# The notes shared by several rows.
_SAME = "the same"
_NO_IDX = "no `dataloader_idx` argument (a default of 0 keeps such a signature working); several loaders run in order"
_NEVER = "not called (defining it is an error at setup): "
_NOT_A_HOOK = "not a hook (defining it is an error at setup): "
_MODEL_MODE = "every model is put in eval mode for the run, and back in its previous mode after it"
_BEFORE_BACKWARD = "the loss as `training_step` computed it (Lightning's is divided by `accumulate_grad_batches`)"
_BEFORE_STEP = "gradients already unscaled and clipped (Lightning clips after this hook)"
_BATCH_END = (
    '`outputs` is what `training_step` returned, as it returned it (Lightning passes `{"loss": ...}`, the loss '
    "divided by `accumulate_grad_batches`)"
)
_WINDOW = "the same: per optimizer, at the start of each accumulation window"
_STAGE = (
    '`"fit"`, `"validate"`, `"test"` or `"predict"`, paired with `teardown(stage)` around each call as in '
    "Lightning; models are configured once, at the first"
)
_SAVE = "the same: add entries to the checkpoint (dream_trainer's layout)"
_LOAD = "the same, before the trainer reads the checkpoint"
_EPOCH_END = "the same: after the epoch's validation"

_HOOK_ROWS: dict[str, Ours] = {
    "on_fit_start": Ours("on_fit_start", _SAME),
    "on_train_start": Ours("on_train_start", _SAME),
    "on_train_epoch_start": Ours("on_train_epoch_start", _SAME),
    "on_train_batch_start": Ours(
        "on_train_batch_start", "the same: returning -1 skips this batch and the rest of the epoch"
    ),
    "on_before_zero_grad": Ours("on_before_zero_grad", _WINDOW),
    "on_before_backward": Ours("on_before_backward", _BEFORE_BACKWARD),
    "on_after_backward": Ours("on_after_backward", _SAME),
    "on_before_optimizer_step": Ours("on_before_optimizer_step", _BEFORE_STEP),
    "on_train_batch_end": Ours("on_train_batch_end", _BATCH_END),
    "on_validation_start": Ours("on_validation_start", _SAME),
    "on_validation_epoch_start": Ours("on_validation_epoch_start", _SAME),
    "on_validation_batch_start": Ours("on_validation_batch_start", _NO_IDX),
    "on_validation_batch_end": Ours("on_validation_batch_end", _NO_IDX),
    "on_validation_epoch_end": Ours("on_validation_epoch_end", _SAME),
    "on_validation_end": Ours("on_validation_end", _SAME),
    "on_train_epoch_end": Ours("on_train_epoch_end", _EPOCH_END),
    "on_train_end": Ours("on_train_end", _SAME),
    "on_fit_end": Ours("on_fit_end", _SAME),
    "on_test_start": Ours("on_test_start", _SAME),
    "on_test_epoch_start": Ours("on_test_epoch_start", _SAME),
    "on_test_batch_start": Ours("on_test_batch_start", _NO_IDX),
    "on_test_batch_end": Ours("on_test_batch_end", _NO_IDX),
    "on_test_epoch_end": Ours("on_test_epoch_end", _SAME),
    "on_test_end": Ours("on_test_end", _SAME),
    "on_predict_start": Ours("on_predict_start", _SAME),
    "on_predict_epoch_start": Ours("on_predict_epoch_start", _SAME),
    "on_predict_batch_start": Ours("on_predict_batch_start", _NO_IDX),
    "on_predict_batch_end": Ours("on_predict_batch_end", _NO_IDX),
    "on_predict_epoch_end": Ours("on_predict_epoch_end", _SAME),
    "on_predict_end": Ours("on_predict_end", _SAME),
    "on_save_checkpoint": Ours("on_save_checkpoint", _SAVE),
    "on_load_checkpoint": Ours("on_load_checkpoint", _LOAD),
}
"""The hooks a `LightningModule` and a `Callback` both have, with what they are here: one row each, which
both tables below take by name."""


# A LightningModule's evaluation-loop names that are not hooks here, by the hook they come before / after.
_NOT_HOOKS_BEFORE: dict[str, dict[str, Ours]] = {
    "on_validation_start": {
        "on_validation_model_zero_grad": Ours(
            None, _NOT_A_HOOK + "validation runs under `torch.no_grad()` and leaves gradients alone"
        ),
        "on_validation_model_eval": Ours(None, _NOT_A_HOOK + _MODEL_MODE),
    },
    "on_test_start": {"on_test_model_eval": Ours(None, _NOT_A_HOOK + _MODEL_MODE)},
    "on_predict_start": {"on_predict_model_eval": Ours(None, _NOT_A_HOOK + _MODEL_MODE)},
}
_NOT_HOOKS_AFTER: dict[str, dict[str, Ours]] = {
    "on_validation_end": {"on_validation_model_train": Ours(None, _NOT_A_HOOK + _MODEL_MODE)},
    "on_test_end": {"on_test_model_train": Ours(None, _NOT_A_HOOK + _MODEL_MODE)},
}


def _module_hooks() -> dict[str, Ours]:
    """The LightningModule's hooks (`HOOKS` a module has, in firing order), each with its row, and the
    evaluation-loop names that are not hooks here where Lightning calls them."""
    rows: dict[str, Ours] = {}
    for hook in HOOKS:
        if hook in _HOOK_ROWS:
            rows.update(_NOT_HOOKS_BEFORE.get(hook, {}))
            rows[hook] = _HOOK_ROWS[hook]
            rows.update(_NOT_HOOKS_AFTER.get(hook, {}))
    return rows


MODULE_NAMES: dict[str, Ours] = {
    # --- what a LightningModule writes
    "forward": Ours("forward", "the same: `self(x)` runs it (define it on the trainer, usually `self.model(x)`)"),
    "training_step": Ours(
        "training_step",
        'the same; `batch_idx` may be left out; return the loss (or a dict with `"loss"`), or call '
        "`self.backward` and `self.step`; Lightning 1.x's `optimizer_idx` fails at setup",
    ),
    "validation_step": Ours(
        "validation_step",
        "the same: return a dict of metrics, or `self.log(...)`; `dataloader_idx` with several loaders",
    ),
    "test_step": Ours("test_step", "the same, run by `test()`"),
    "predict_step": Ours("predict_step", "the same, run by `predict()`, which returns the outputs"),
    "configure_optimizers": Ours(
        "configure_optimizers",
        "assign optimizers and schedulers to `self`, or return any of Lightning's forms; a scheduler dict's "
        '`interval` and `monitor` apply to it; `"frequency"` other than 1 and `"strict": False` are refused at setup',
    ),
    "configure_model": Ours(
        "configure_models",
        'build the models and assign them to `self`; with `config.init_device="meta"` it runs on the meta device '
        "and `init_weights()` initializes them once they are allocated",
    ),
    "configure_sharded_model": Ours("configure_models", "Lightning's older name of `configure_model`"),
    "configure_callbacks": Ours(
        "config.callbacks",
        _NEVER + "list the callbacks in `config.callbacks`, or `self.callbacks.append(cb)` before `fit()`",
    ),
    "configure_gradient_clipping": Ours(
        None,
        _NEVER + "set `config.gradient_clip_val` (and `gradient_clip_algorithm`), or call "
        "`self.clip_gradients(optimizer, max_norm)` in `training_step` for one step",
    ),
    # --- data
    "prepare_data": Ours(
        "prepare_data",
        "the same: once per `fit()` setup, on global rank zero, before `setup` (the other ranks wait); or a "
        "`DataModule`'s",
    ),
    "setup": Ours("setup", "the same, before `configure_models`; " + _STAGE),
    "teardown": Ours(
        "teardown", "the same: at the end of each `fit()`, `validate()`, `test()`, `predict()`, also after an exception"
    ),
    "train_dataloader": Ours(
        "configure_dataloaders",
        "returns `(train_loader, val_loader or None)`; or a `DataModule`'s `train_dataloader()`; a "
        "`train_dataloader()` defined on the trainer is called by the default `configure_dataloaders`",
    ),
    "val_dataloader": Ours(
        "configure_dataloaders",
        "the second item it returns (a list for several loaders); a `val_dataloader()` defined on the trainer is "
        "called with `train_dataloader()`",
    ),
    "test_dataloader": Ours(
        "configure_test_dataloader",
        "or the loader passed to `test(loader)`, or a `DataModule`'s `test_dataloader()`; one defined on the "
        "trainer is called by the default",
    ),
    "predict_dataloader": Ours(
        "configure_predict_dataloader",
        "or the loader passed to `predict(loader)`, or a `DataModule`'s `predict_dataloader()`; one defined on the "
        "trainer is called by the default",
    ),
    "transfer_batch_to_device": Ours(
        None,
        _NEVER + "the trainer moves the tensors in dicts, lists and tuples, and objects with a `.to(device)`; "
        "move anything else in the step",
    ),
    "on_before_batch_transfer": Ours(None, _NOT_A_HOOK + "transform batches in the `DataLoader`'s `collate_fn`"),
    "on_after_batch_transfer": Ours(
        None, _NOT_A_HOOK + "transform the batch at the top of the step, where it is on the device already"
    ),
    # --- what a LightningModule calls
    "log": Ours(
        "log",
        "the same options but `enable_graph`, `sync_dist_group`, `add_dataloader_idx`, `metric_attribute` and "
        '`rank_zero_only`; `reduce_fx` is `"mean"` only; values are always averaged over the ranks',
    ),
    "log_dict": Ours("log_dict", "`log` for each entry, with `log`'s options"),
    "print": Ours("print", "the same: prints on global rank zero only"),
    "all_gather": Ours(
        "all_gather",
        "one tensor, returned as a list in rank order (`torch.stack` it for Lightning's shape); no `sync_grads`; "
        "`all_gather_object` for any picklable object",
    ),
    "manual_backward": Ours(
        "backward",
        "`backward(loss, optimizer=None, **kwargs)`: with `optimizer`, gradients only for that optimizer's parameters "
        "(under FSDP2 use `toggle_optimizer` instead)",
    ),
    "backward": Ours(
        "backward",
        "here the verb (Lightning's `manual_backward`), also used for a returned loss; keyword arguments such as "
        "`retain_graph=True` go to `loss.backward`",
    ),
    "optimizers": Ours(
        "optimizers",
        "the same order and shape, but the torch optimizers themselves: step one with `self.step(opt)`, "
        "not `opt.step()`",
    ),
    "lr_schedulers": Ours(
        "lr_schedulers",
        "the same: None, one scheduler or a list; the trainer steps them, also in manual optimization",
    ),
    "toggle_optimizer": Ours(
        "toggle_optimizer", "the same; also a context manager: `with self.toggle_optimizer(opt):`"
    ),
    "untoggle_optimizer": Ours("untoggle_optimizer", _SAME),
    "toggled_optimizer": Ours("toggled_optimizer", "the same (another name of `toggle_optimizer`)"),
    "clip_gradients": Ours(
        "clip_gradients",
        '`clip_gradients(optimizer, max_norm, algorithm="norm" or "value")`, applied at that '
        "optimizer's next step, after fp16 unscaling",
    ),
    "optimizer_step": Ours(
        None,
        _NEVER + "the trainer steps every optimizer, or `training_step` calls `self.step(opt)`; for a warm-up "
        'use a scheduler with `"interval": "step"`',
    ),
    "optimizer_zero_grad": Ours(
        None,
        _NEVER + "every optimizer is zeroed (`set_to_none=True`) at the start of each accumulation window, "
        "after `on_before_zero_grad`",
    ),
    "lr_scheduler_step": Ours(
        None,
        _NEVER + "schedulers step at their interval; to step one yourself, keep it private "
        "(`self._sched = ...`) and call its `step()`",
    ),
    "freeze": Ours(
        None,
        "the trainer is no module: `self.model.requires_grad_(False)` and `self.model.eval()` "
        "(`BaseFinetuning.freeze` does it per module)",
    ),
    "unfreeze": Ours(None, "the trainer is no module: `self.model.requires_grad_(True)` and `self.model.train()`"),
    "to_onnx": Ours(None, "not supported: `torch.onnx.export(self.model, example, path)`"),
    "to_torchscript": Ours(
        None, "not supported: `torch.jit.script(self.model)`, or `torch.export.export(self.model, example)`"
    ),
    "to_tensorrt": Ours(None, "not supported: compile `self.model` with `torch_tensorrt`"),
    "save_hyperparameters": Ours(
        None,
        "not needed: hyperparameters are fields of your `DreamTrainerConfig` subclass, logged and saved in every "
        "checkpoint (a `DataModule` has `save_hyperparameters`)",
    ),
    "load_from_checkpoint": Ours(
        "load_from_checkpoint",
        "the same classmethod; the config comes from the checkpoint, keyword arguments override its fields "
        '(`device="cpu"` for `map_location`)',
    ),
    # --- properties
    "hparams": Ours("config", "`self.config.lr` for `self.hparams.lr`"),
    "hparams_initial": Ours("config", "the config the trainer was built with"),
    "remove_ignored_hparams": Ours(None, "part of `save_hyperparameters`: not needed"),
    "trainer": Ours(
        "trainer",
        "`self` (the trainer is also the module), so `self.trainer.current_epoch` works; "
        "`self.trainer.max_epochs` is `self.config.n_epochs`",
    ),
    "fabric": Ours(None, "not supported: the trainer runs the loop; there is no Fabric"),
    "current_epoch": Ours("current_epoch", _SAME),
    "global_step": Ours("global_step", "counts training steps (accumulation windows), not optimizer steps: see below"),
    "global_rank": Ours("global_rank", _SAME),
    "local_rank": Ours("local_rank", _SAME),
    "device": Ours("device", "the same: where batches and models are placed"),
    "on_gpu": Ours("device", '`self.device.type == "cuda"`'),
    "dtype": Ours(
        None,
        "the trainer is no module: each model keeps its own dtype; `config.mixed_precision` sets the autocast dtype",
    ),
    "device_mesh": Ours(
        "device_mesh",
        'the world mesh of `strategy="model_parallel"`, None otherwise; sub-meshes: `self.parallel.submesh("tp")`',
    ),
    "automatic_optimization": Ours(
        None,
        "no switch: a `training_step` that calls `self.step(optimizer)` optimizes by hand for that step; the "
        "trainer still zeroes, unscales, clips and accumulates",
    ),
    "example_input_array": Ours(None, "not read: `ModelSummary` counts parameters without running a model"),
    "logger": Ours("logger", "the same: the first of `self.loggers`, or None"),
    "loggers": Ours("loggers", "the same: `config.loggers`, or one `TensorBoardLogger`"),
    "strict_loading": Ours(
        "load_checkpoint",
        "`load_checkpoint(path, strict=False)` or `load_from_checkpoint(path, strict=False)`; "
        "`fit(ckpt_path=...)` loads strictly",
    ),
    "CHECKPOINT_HYPER_PARAMS_KEY": Ours(
        None, 'a checkpoint holds the config as plain data, in `checkpoint["dream_trainer"]["config"]`'
    ),
    "CHECKPOINT_HYPER_PARAMS_NAME": Ours(None, "no name: the config is stored whole"),
    "CHECKPOINT_HYPER_PARAMS_TYPE": Ours(
        None, "`load_from_checkpoint` rebuilds the config as the trainer class's config class (`config_class`)"
    ),
    # --- hooks, in firing order, with the evaluation-loop names that are not hooks here
    **_module_hooks(),
}
"""Every public name of Lightning 2.x's `LightningModule` but `torch.nn.Module`'s (plus `forward`, which
a `LightningModule` writes): where it is on a `DreamTrainer`, or None and what to write instead."""

_CALLBACK_ONLY: dict[str, Ours] = {  # the Callback hooks a LightningModule does not have
    "setup": Ours("setup", _STAGE),
    "on_sanity_check_start": Ours("on_sanity_check_start", _SAME),
    "on_sanity_check_end": Ours("on_sanity_check_end", _SAME),
    "on_exception": Ours("on_exception", "the same: when `fit()` fails, before `teardown`"),
    "teardown": Ours(
        "teardown", "the same: at the end of each `fit()`, `validate()`, `test()`, `predict()`, also after an exception"
    ),
}


def _callback_row(hook: str) -> Ours:
    """A hook's row; a hook declared on `Callback` without one stops the import, saying where to add it."""
    row = _CALLBACK_ONLY.get(hook) or _HOOK_ROWS.get(hook)
    if row is None:
        raise KeyError(
            f"hook {hook!r} has no row in dream_trainer/lightning/names.py: add one to _HOOK_ROWS (when a "
            "LightningModule has the hook too) or to _CALLBACK_ONLY, saying what Lightning calls it"
        )
    return row


CALLBACK_NAMES: dict[str, Ours] = {
    # dream_trainer's `Callback` has every hook of Lightning's, under its name and in its order (`HOOKS`).
    **{hook: _callback_row(hook) for hook in HOOKS},
    "state_dict": Ours("state_dict", "the same: saved in checkpoints under `state_key`"),
    "load_state_dict": Ours("load_state_dict", "the same: given back on resume"),
    "state_key": Ours("state_key", "the class name by default: override it when a run holds two of a kind"),
}
"""Every hook of Lightning 2.x's `Callback`: the `dream_trainer.Callback` hook of the same name, which
takes `(self, trainer, ...)` without `pl_module` (the trainer is also the module)."""


# Lightning calls these when a LightningModule defines them; dream_trainer never does, so a trainer that
# defines one is refused at setup with the note (see `never_called_overrides`).
NEVER_CALLED: tuple[str, ...] = (
    "configure_callbacks",
    "configure_gradient_clipping",
    "transfer_batch_to_device",
    "optimizer_step",
    "optimizer_zero_grad",
    "lr_scheduler_step",
)

# Lightning 1.x LightningModule hooks that 2.x removed: also never called here.
OLDER_MODULE_HOOKS: dict[str, str] = {
    "training_epoch_end": "Lightning 1.x's; define on_train_epoch_end(self) and keep what you need from the steps "
    "(`self.log(..., on_epoch=True)` averages a value over the epoch)",
    "validation_epoch_end": "Lightning 1.x's; define on_validation_epoch_end(self); validation_step's returned "
    "dicts are averaged for you",
    "test_epoch_end": "Lightning 1.x's; define on_test_epoch_end(self); test_step's returned dicts are averaged",
    "training_step_end": "Lightning 1.x's (DataParallel); do the work at the end of training_step",
    "validation_step_end": "Lightning 1.x's (DataParallel); do the work at the end of validation_step",
    "test_step_end": "Lightning 1.x's (DataParallel); do the work at the end of test_step",
}


def never_called_overrides(cls: type) -> list[tuple[str, str]]:
    """`(name, what to do instead)` for each Lightning method `cls` defines (itself or a base class
    outside dream_trainer) that dream_trainer never calls. Read once, at setup."""
    found = []
    for name in (*NEVER_CALLED, *OLDER_MODULE_HOOKS):
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or owner.__module__.startswith("dream_trainer."):
            continue
        note = OLDER_MODULE_HOOKS.get(name) or MODULE_NAMES[name].note
        found.append((name, note))
    return found
