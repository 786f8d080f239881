"""StateFormatMixin: the checkpoint format that is the same for one process, DDP and FSDP.

Models are saved as full (unsharded, unwrapped) state dicts and optimizer state is keyed by
parameter name, so a file written under one strategy loads under any other, at any world size.
FSDP can instead write sharded `torch.distributed.checkpoint` directories (the `_sharded_*` part).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dream_trainer.errors import CheckpointError
from dream_trainer.mixins.distributed import DistributedMixin
from dream_trainer.utils.modules import unwrap


class StateFormatMixin(DistributedMixin):
    """Model and optimizer state in the strategy-independent format (used by `StateDictMixin` and `CheckpointMixin`)."""

    # --- one format for every strategy -------------------------------------------------------------
    # Models as full (unsharded, unwrapped) state dicts, optimizers keyed by parameter name (FQN), so
    # a checkpoint written by one process, DDP or FSDP loads under any of them, at any world size.
    def _is_sharded(self, model: Any) -> bool:
        return self.parallel.is_sharded(model)

    def _model_state(self, model: Any) -> dict[str, Any]:
        if self._is_sharded(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # Collective: every rank takes part; the full tensors land on the CPU of rank 0.
            return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return unwrap(model).state_dict()

    def _load_model_state(self, model: Any, state: dict[str, Any], strict: bool) -> None:
        if self._is_sharded(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(unwrap(model), state, options=StateDictOptions(full_state_dict=True, strict=strict))
        else:
            unwrap(model).load_state_dict(state, strict=strict)

    def _all_models(self) -> Any:
        from torch import nn

        return nn.ModuleDict({n: unwrap(m) for n, m in self.named_models()})

    def _param_fqns(self) -> dict[int, str]:
        """id(parameter) -> its name in `_all_models()` (the optimizer-state keys of the format)."""
        return {id(p): n for n, p in self._all_models().named_parameters(remove_duplicate=False)}

    def _optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        sharded = any(self._is_sharded(m) for _, m in self.named_models())
        names = self._param_fqns()
        if not sharded and all(id(p) in names for g in optimizer.param_groups for p in g["params"]):
            # The optimizer's own state dict with positions renamed to parameter names: the same
            # format torch's get_optimizer_state_dict gives, without importing DCP or its copies.
            order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
            plain = optimizer.state_dict()
            return {
                "state": {order[i]: v for i, v in plain["state"].items()},
                "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in plain["param_groups"]],
            }
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=sharded)
        return get_optimizer_state_dict(self._all_models(), optimizer, options=opts)

    def _load_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        sharded = any(self._is_sharded(m) for _, m in self.named_models())
        if not sharded:
            # Unsharded: map parameter names back to positions and use the optimizer's own loader
            # (torch's generic state-dict utilities cost several times the file read here).
            names = self._param_fqns()
            groups = []
            by_position: dict[int, Any] = {}
            index = 0
            for live, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
                positions = []
                for param in live["params"]:
                    fqn = names.get(id(param))
                    if fqn in state["state"]:
                        by_position[index] = state["state"][fqn]
                    positions.append(index)
                    index += 1
                groups.append({**saved, "params": positions})
            optimizer.load_state_dict({"state": by_position, "param_groups": groups})
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            self._all_models(), optimizer, state, options=StateDictOptions(full_state_dict=sharded)
        )

    # --- sharded (DCP) checkpoints ------------------------------------------------------------------
    @property
    def sharded_checkpoints(self) -> bool:
        """True when checkpoints are sharded DCP directories rather than files: FSDP, unless
        `fsdp_sharded_checkpoints=False`."""
        return self.parallel.sharded_checkpoints

    def _sharded_tensors(self) -> dict[str, Any]:
        """The live model/optimizer state dicts, sharded where the models are (no gathering)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        container = self._all_models()
        return {
            "models": {n: get_model_state_dict(unwrap(m)) for n, m in self.named_models()},
            "optimizers": {n: get_optimizer_state_dict(container, o) for n, o in self.named_optimizers()},
        }

    def _load_sharded_tensors(self, path: Path, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from dream_trainer.utils.sharded_checkpoint import load_sharded_tensors

        live = self._sharded_tensors()  # the layout to fill: DCP reshards into it
        try:
            load_sharded_tensors(live, path)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"cannot load sharded checkpoint {str(path)!r} into this trainer's models/optimizers: {exc}"
            ) from exc
        container = self._all_models()
        for name, model in self.named_models():
            set_model_state_dict(unwrap(model), live["models"][name], options=StateDictOptions(strict=strict))
        for name, opt in self.named_optimizers():
            set_optimizer_state_dict(container, opt, live["optimizers"][name])
