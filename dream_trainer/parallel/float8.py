"""Float8 training of `nn.Linear` layers with torchao (`config.float8`).

Float8 matmuls need tensor cores that have them: CUDA with compute capability 8.9 or newer (Ada, Hopper,
Blackwell). torchao is not a dependency of dream_trainer; it is imported only here, when asked for.
Apply first, before tensor parallelism, activation checkpointing, compile and FSDP (torchtitan's order:
the Linear modules are swapped, then wrapped). With tensor parallelism, a plan over float8 Linears uses
torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` (torchao.float8.float8_tensor_parallel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dream_trainer.errors import MisconfigurationError

__all__ = ["FLOAT8_RECIPES", "apply_float8", "check_float8_supported"]

FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_MIN_CAPABILITY = (8, 9)


def check_float8_supported(device: torch.device | str) -> None:
    """Raise `MisconfigurationError` unless float8 training can run on `device`: a CUDA device of compute
    capability >= 8.9, with torchao installed."""
    device = torch.device(device)
    if device.type != "cuda":
        raise MisconfigurationError(
            f"config.float8=True needs a CUDA GPU with compute capability >= 8.9 (e.g. H100, L40, RTX 4090) "
            f"and torchao (`pip install torchao`), but the trainer runs on device {str(device)!r}. "
            "Set config.float8=False, or run on such a GPU"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        raise MisconfigurationError(
            f"config.float8=True needs compute capability >= 8.9, but {torch.cuda.get_device_name(device)} "
            f"({device}) has {capability[0]}.{capability[1]}: set config.float8=False, or run on an Ada/Hopper GPU"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise MisconfigurationError(
            "config.float8=True needs torchao, which is not installed: `pip install torchao` "
            f"(a build matching torch {torch.__version__}), or set config.float8=False"
        ) from exc


def apply_float8(
    model: nn.Module,
    device: torch.device | str,
    *,
    recipe: str = "tensorwise",
    skip_fqns: Sequence[str] = ("output", "lm_head"),
    fsdp_float8_all_gather: bool = False,
) -> nn.Module:
    """Swap `model`'s eligible `nn.Linear` layers for torchao's float8 training Linear, in place;
    returns `model`. Refuses (MisconfigurationError) when `check_float8_supported(device)` does.

    `recipe`: "tensorwise" (fastest; one scale per tensor), "rowwise" (a scale per row: more accurate),
    "rowwise_with_gw_hp" (rowwise, weight gradients in high precision: most accurate).
    A Linear is skipped when its name is, or ends with ".NAME" for, a NAME in `skip_fqns` (output heads
    are sensitive to precision) or a dimension is not a multiple of 16 (the float8 kernels' requirement).
    `fsdp_float8_all_gather=True` (tensorwise only) all-gathers FSDP shards in float8, halving that
    traffic; then call `torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)` after each
    optimizer step.
    """
    if recipe not in FLOAT8_RECIPES:
        valid = ", ".join(repr(r) for r in FLOAT8_RECIPES)
        raise MisconfigurationError(f"float8 recipe={recipe!r} is invalid: valid choices are {valid}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise MisconfigurationError(
            f"fsdp_float8_all_gather=True works with recipe='tensorwise' only, not recipe={recipe!r}"
        )
    check_float8_supported(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(fqn == s or fqn.endswith("." + s) for s in skip_fqns):
            return False
        out_features, in_features = module.weight.shape
        return out_features % 16 == 0 and in_features % 16 == 0

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return model
