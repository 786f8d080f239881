"""BaseFinetuning and BackboneFinetuning: freeze modules, unfreeze them later with their own learning rate."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from dream_trainer.callbacks.base import Callback
from dream_trainer.errors import ConfigError, MisconfigurationError
from dream_trainer.utils.modules import unwrap
from dream_trainer.utils.warn import warn_user

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from dream_trainer.protocol import TrainerProtocol

Modules = nn.Module | Iterable[nn.Module]


def multiplicative(epoch: int) -> float:
    """`BackboneFinetuning`'s default `lambda_func` (Lightning's): the backbone's learning rate grows by
    1.5 each epoch after it is unfrozen."""
    return 1.5


class BaseFinetuning(Callback):
    """Base class for callbacks that freeze modules before training and unfreeze them during it.

    Subclasses implement `freeze_before_training(trainer)` (called when `fit()` starts on a fresh run)
    and `finetune_function(trainer, epoch, optimizer)` (called at the start of every training epoch, once
    per optimizer), with the static helpers `freeze`, `make_trainable`, `unfreeze_and_add_param_group`,
    `filter_params` and `filter_on_optimizer`, as in Lightning (the first argument is the trainer, not a
    LightningModule: reach the models with `dict(trainer.named_models())`).

    Frozen parameters never get an optimizer state: `configure_optimizers` runs before any callback can
    freeze, so when `fit()` starts every parameter that is frozen then (`requires_grad=False`) and has no
    optimizer state yet is taken out of the optimizers' parameter groups; `unfreeze_and_add_param_group`
    adds it back in a group of its own.

    Checkpoints carry, per optimizer, its parameter groups (parameter names and learning rates), which
    parameters are frozen, and the last epoch handled, so a resumed run (also across the unfreeze epoch,
    also mid-epoch) rebuilds the same groups before the optimizer's state is loaded into them.
    """

    def __init__(self) -> None:
        self._last_epoch = -1  # the last epoch finetune_function ran for
        self._restored: dict[str, Any] | None = None  # the state a checkpoint restored (on_load_checkpoint)

    # --- what subclasses implement ----------------------------------------------------------------
    def freeze_before_training(self, trainer: TrainerProtocol) -> None:
        """Freeze the modules to fine-tune later (use `self.freeze(...)`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement freeze_before_training(trainer)")

    def finetune_function(self, trainer: TrainerProtocol, epoch: int, optimizer: Optimizer) -> None:
        """At the start of epoch `epoch`: unfreeze modules (`self.unfreeze_and_add_param_group(...)`) or
        change the learning rates of their groups."""
        raise NotImplementedError(f"{type(self).__name__} must implement finetune_function(trainer, epoch, optimizer)")

    # --- helpers (Lightning's) --------------------------------------------------------------------
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The leaf modules of `modules` (a module or an iterable of modules), and the parents that hold
        parameters of their own."""
        if isinstance(modules, nn.ModuleDict):
            modules = modules.values()
        found: list[nn.Module] = []
        if isinstance(modules, nn.Module):
            found = list(modules.modules())
        else:
            for m in modules:
                found.extend(BaseFinetuning.flatten_modules(m))
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(
        modules: Modules, train_bn: bool = True, requires_grad: bool = True
    ) -> Generator[nn.Parameter, None, None]:
        """The parameters of `modules` whose `requires_grad` is `requires_grad` (BatchNorm layers'
        only when `train_bn`)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for param in mod.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Unfreeze every parameter of `modules` (BatchNorm layers track running statistics again)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """Freeze the parameters `module` holds itself (a BatchNorm layer stops tracking statistics)."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze every parameter of `modules`; BatchNorm layers stay trainable when `train_bn`."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """`params` without those `optimizer` already holds (with a warning naming how many)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        out = [p for p in params if id(p) not in held]
        if len(out) != len(params):
            warn_user(
                f"{len(params) - len(out)} of the parameters to add are already in the optimizer; they were "
                "left in their groups",
            )
        return out

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze `modules` and add their parameters to `optimizer` as a new group, with learning rate
        `lr`, or (when `lr` is None) the first group's learning rate divided by `initial_denom_lr`."""
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        )
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    # --- names ------------------------------------------------------------------------------------
    @staticmethod
    def _named_parameters(trainer: TrainerProtocol) -> dict[str, nn.Parameter]:
        """`"<model attribute>.<parameter name>"` -> parameter, for every model of the trainer."""
        out: dict[str, nn.Parameter] = {}
        for model_name, model in trainer.named_models():
            for name, p in unwrap(model).named_parameters():
                out[f"{model_name}.{name}"] = p
        return out

    @staticmethod
    def _named_modules(trainer: TrainerProtocol) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {}
        for model_name, model in trainer.named_models():
            for name, m in unwrap(model).named_modules():
                out[f"{model_name}.{name}" if name else model_name] = m
        return out

    # --- hooks ------------------------------------------------------------------------------------
    def on_load_checkpoint(self, trainer: TrainerProtocol, checkpoint: dict[str, Any]) -> None:
        # Before the trainer loads the optimizers' states: give each optimizer the groups it had when
        # the checkpoint was written, or the saved state would not fit (another number of groups).
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not state or "optimizers" not in state:
            return
        by_name = self._named_parameters(trainer)
        optimizers = dict(trainer.named_optimizers())
        for opt_name, groups in state["optimizers"].items():
            optimizer = optimizers.get(opt_name)
            if optimizer is None:
                continue
            missing = [n for g in groups for n in g["params"] if n not in by_name]
            if missing:
                raise MisconfigurationError(
                    f"{type(self).__name__}: the checkpoint's optimizer {opt_name!r} holds parameters the models "
                    f"do not have: {missing[:5]}"
                )
            template = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
            optimizer.param_groups = [
                {
                    **template,
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [by_name[n] for n in g["params"]],
                }
                for g in groups
            ]
        self._apply_frozen(trainer, state)
        self._restored = state

    def _apply_frozen(self, trainer: TrainerProtocol, state: dict[str, Any]) -> None:
        frozen = set(state.get("frozen", ()))
        for name, p in self._named_parameters(trainer).items():
            p.requires_grad_(name not in frozen)
        untracked = set(state.get("bn_untracked", ()))
        for name, m in self._named_modules(trainer).items():
            if isinstance(m, _BatchNorm):
                m.track_running_stats = name not in untracked

    @staticmethod
    def _check_ddp(trainer: TrainerProtocol, frozen: set[int]) -> None:
        """DDP registers the parameters that require a gradient when it wraps the model (before any
        callback runs), and without `find_unused_parameters` it waits for a gradient of each of them in
        every backward: one frozen later would hang or fail the second step. With it, DDP skips them
        while frozen and averages their gradients again once they are unfrozen."""
        for name, model in trainer.named_models():
            if not isinstance(model, DistributedDataParallel) or model.find_unused_parameters:
                continue
            if any(id(p) in frozen for p in model.parameters()):
                raise MisconfigurationError(
                    f"trainer.{name} is wrapped in DistributedDataParallel with find_unused_parameters=False, "
                    "which waits for a gradient of every parameter it registered, and the finetuning callback "
                    "froze some of them: set DreamTrainerConfig(find_unused_parameters=True)"
                )

    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        if self._restored is not None:  # resumed: the checkpoint said what is frozen and grouped
            self._last_epoch = int(self._restored.get("last_epoch", -1))
            self._restored = None
            self._check_ddp(trainer, {id(p) for p in self._named_parameters(trainer).values() if not p.requires_grad})
            return
        self._last_epoch = -1
        trainable = {id(p) for p in self._named_parameters(trainer).values() if p.requires_grad}
        self.freeze_before_training(trainer)
        frozen_now = {id(p) for p in self._named_parameters(trainer).values() if not p.requires_grad}
        self._check_ddp(trainer, trainable & frozen_now)
        for _, optimizer in trainer.named_optimizers():
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p.requires_grad or p in optimizer.state]

    def on_train_epoch_start(self, trainer: TrainerProtocol) -> None:
        epoch = trainer.current_epoch
        if epoch <= self._last_epoch:  # a mid-epoch resume reopens an epoch already handled
            return
        for _, optimizer in trainer.named_optimizers():
            self.finetune_function(trainer, epoch, optimizer)
        self._last_epoch = epoch

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self._last_epoch}

    def on_save_checkpoint(self, trainer: TrainerProtocol, checkpoint: dict[str, Any]) -> None:
        # state_dict() has no trainer: the groups, by parameter name, are added to this callback's entry.
        names = {id(p): n for n, p in self._named_parameters(trainer).items()}
        entry = checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {})
        entry["optimizers"] = {
            opt_name: [
                {
                    "params": [names[id(p)] for p in group["params"] if id(p) in names],
                    "lr": float(group["lr"]),
                    **({"initial_lr": float(group["initial_lr"])} if "initial_lr" in group else {}),
                }
                for group in optimizer.param_groups
            ]
            for opt_name, optimizer in trainer.named_optimizers()
        }
        entry["frozen"] = [n for n, p in self._named_parameters(trainer).items() if not p.requires_grad]
        entry["bn_untracked"] = [
            n
            for n, m in self._named_modules(trainer).items()
            if isinstance(m, _BatchNorm) and not m.track_running_stats
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_epoch = int(state_dict.get("last_epoch", -1))


class BackboneFinetuning(BaseFinetuning):
    """Freeze a model's backbone, unfreeze it at epoch `unfreeze_backbone_at_epoch` (Lightning's meaning).

    When `fit()` starts, `<model>.<backbone_attr>` is frozen (BatchNorm layers stay trainable when
    `train_bn`). At the start of epoch `unfreeze_backbone_at_epoch` it is unfrozen and added to the
    optimizer as a new parameter group, with learning rate `backbone_initial_lr`, or else the first
    group's current learning rate times `backbone_initial_ratio_lr`. At the start of each later epoch
    its learning rate is multiplied by `lambda_func(epoch + 1)`; with `should_align` it never exceeds
    the first group's learning rate.

    Args:
        unfreeze_backbone_at_epoch: the epoch (0-based) at whose start the backbone is unfrozen.
        lambda_func: epoch -> factor for the backbone's learning rate (default: 1.5 every epoch).
        backbone_initial_ratio_lr: the backbone's first learning rate relative to the first group's.
        backbone_initial_lr: the backbone's first learning rate (overrides the ratio).
        should_align: cap the backbone's learning rate at the first group's.
        initial_denom_lr: kept for Lightning's signature; `unfreeze_and_add_param_group` divides by it only
            when no learning rate is given, and this callback always gives one (as Lightning's does).
        train_bn: BatchNorm layers of the backbone are trained while it is frozen.
        backbone_attr: the backbone's name inside the model (dotted for nested modules, e.g. `"encoder.body"`).
        model: the trainer attribute that holds the model.
        optimizer: the trainer attribute of the optimizer that gets the backbone's group. Default: the only
            optimizer, or the first one holding parameters of `model`.
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 0.1,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        backbone_attr: str = "backbone",
        model: str = "model",
        optimizer: str | None = None,
    ) -> None:
        super().__init__()

        def positive(x: Any) -> bool:
            return not isinstance(x, bool) and isinstance(x, (int, float)) and x > 0

        if (
            isinstance(unfreeze_backbone_at_epoch, bool)
            or not isinstance(unfreeze_backbone_at_epoch, int)
            or unfreeze_backbone_at_epoch < 0
        ):
            raise ConfigError(
                f"BackboneFinetuning(unfreeze_backbone_at_epoch={unfreeze_backbone_at_epoch!r}) is invalid: "
                "expected an epoch index, an integer >= 0"
            )
        if not callable(lambda_func):
            raise ConfigError(
                f"BackboneFinetuning(lambda_func={lambda_func!r}) is invalid: expected a callable epoch -> factor"
            )
        if not positive(backbone_initial_ratio_lr):
            raise ConfigError(
                f"BackboneFinetuning(backbone_initial_ratio_lr={backbone_initial_ratio_lr!r}) is invalid: "
                "expected a positive number, e.g. 0.1"
            )
        if backbone_initial_lr is not None and not positive(backbone_initial_lr):
            raise ConfigError(
                f"BackboneFinetuning(backbone_initial_lr={backbone_initial_lr!r}) is invalid: expected None or a "
                "positive number"
            )
        if not positive(initial_denom_lr):
            raise ConfigError(
                f"BackboneFinetuning(initial_denom_lr={initial_denom_lr!r}) is invalid: expected a positive number"
            )
        for arg, value in (("backbone_attr", backbone_attr), ("model", model)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"BackboneFinetuning({arg}={value!r}) is invalid: expected a non-empty name")
        if optimizer is not None and (not isinstance(optimizer, str) or not optimizer):
            raise ConfigError(
                f"BackboneFinetuning(optimizer={optimizer!r}) is invalid: expected None or an optimizer's "
                "attribute name"
            )
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = float(backbone_initial_ratio_lr)
        self.backbone_initial_lr = float(backbone_initial_lr) if backbone_initial_lr is not None else None
        self.should_align = should_align
        self.initial_denom_lr = float(initial_denom_lr)
        self.train_bn = train_bn
        self.backbone_attr = backbone_attr
        self.model = model
        self.optimizer = optimizer
        self.previous_backbone_lr: float | None = None

    def backbone(self, trainer: TrainerProtocol) -> nn.Module:
        """The module this callback freezes and unfreezes."""
        models = dict(trainer.named_models())
        if self.model not in models:
            raise MisconfigurationError(
                f"BackboneFinetuning(model={self.model!r}): {type(trainer).__name__} has no model of that name; "
                f"its models are {sorted(models)}"
            )
        root = unwrap(models[self.model])
        try:
            return root.get_submodule(self.backbone_attr)
        except AttributeError as exc:
            raise MisconfigurationError(
                f"BackboneFinetuning(backbone_attr={self.backbone_attr!r}): {type(root).__name__} (trainer."
                f"{self.model}) has no submodule of that name; its children are "
                f"{[n for n, _ in root.named_children()]}"
            ) from exc

    def _target_optimizer(self, trainer: TrainerProtocol) -> str:
        optimizers = dict(trainer.named_optimizers())
        if self.optimizer is not None:
            if self.optimizer not in optimizers:
                raise MisconfigurationError(
                    f"BackboneFinetuning(optimizer={self.optimizer!r}): {type(trainer).__name__} has no optimizer "
                    f"of that name; its optimizers are {sorted(optimizers)}"
                )
            return self.optimizer
        if len(optimizers) == 1:
            return next(iter(optimizers))
        params = {id(p) for p in unwrap(dict(trainer.named_models())[self.model]).parameters()}
        for name, opt in optimizers.items():
            if any(id(p) in params for g in opt.param_groups for p in g["params"]):
                return name
        raise MisconfigurationError(
            f"BackboneFinetuning: no optimizer holds parameters of trainer.{self.model}; name one with optimizer="
        )

    def on_fit_start(self, trainer: TrainerProtocol) -> None:
        self.backbone(trainer)  # fails early, naming the model's children, when it is not there
        self._optimizer_name = self._target_optimizer(trainer)
        super().on_fit_start(trainer)

    def freeze_before_training(self, trainer: TrainerProtocol) -> None:
        self.freeze(self.backbone(trainer), train_bn=self.train_bn)

    def finetune_function(self, trainer: TrainerProtocol, epoch: int, optimizer: Optimizer) -> None:
        if trainer.optimizer_name(optimizer) != getattr(self, "_optimizer_name", None):
            return
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial_backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.previous_backbone_lr = initial_backbone_lr
            self.unfreeze_and_add_param_group(
                self.backbone(trainer),
                optimizer,
                initial_backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            current_lr = optimizer.param_groups[0]["lr"]
            next_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and next_lr > current_lr:
                next_lr = current_lr
            optimizer.param_groups[-1]["lr"] = next_lr
            self.previous_backbone_lr = next_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self._last_epoch, "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        prev = state_dict.get("previous_backbone_lr")
        self.previous_backbone_lr = float(prev) if prev is not None else None
