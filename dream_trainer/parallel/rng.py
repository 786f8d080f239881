"""Random numbers on a CPU device mesh: DTensor random ops, and the fp16 scaler's verdict across meshes.

DTensor random ops (`torch.nn.init.*` on sharded parameters, as meta-device init runs them; dropout on a
DTensor) go through torch's RNG tracker. On CUDA it is offset-based: each shard draws its own slice of one
Philox stream. torch installs none for CPU meshes (the CPU generator has no offsets), so every rank fills
its local shard from its global RNG, which `config.seed` made equal on every rank: every shard of a
parameter got the SAME values (a meta-initialized `Linear` sharded 4 ways was one quarter repeated 4
times), and ranks with shards of different sizes left their RNGs out of step. `CPUShardRNGTracker` is
installed by the mesh strategies on CPU runs instead.

Plain tensors (dropout on a TP rank's local activation, the usual case) keep using the global RNG, equal
on every rank: the ranks of a TP group draw the same masks where the activation is replicated, as they
must (they hold the same activation), and so do data-parallel ranks (as with Lightning's and torchtitan's
seeding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor._random import _calc_shard_info, _calc_shard_linear_idx, _RNGStateTracker

__all__ = ["CPUShardRNGTracker", "MeshGradScaler", "install_cpu_rng_tracker"]

_GOLDEN = 0x9E3779B97F4A7C15  # spreads shard indices over the 64-bit seed space
_MASK64 = 2**64 - 1


class CPUShardRNGTracker(_RNGStateTracker):
    """DTensor's RNG tracker for CPU meshes: shards of one tensor draw different values, replicas the same.

    Before each random op on a DTensor, one 64-bit number is drawn from the op's generator (the global
    CPU RNG unless the caller passed one): the same number on every rank while their RNGs agree, and
    the same advance of every rank's RNG, whatever its shard's size. The op then runs on a fork of the
    CPU RNG seeded with that number and this rank's shard index (DTensor's own shard numbering, which
    counts a dimension sharded over several mesh dimensions, FSDP over TP, once per shard). Values
    differ from an unsharded draw with the same seed, as they already did.
    """

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    @contextlib.contextmanager
    def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
        coordinate = spec.mesh.get_coordinate()
        if not self.distribute_region_enabled or coordinate is None:  # not on the mesh: nothing is drawn
            yield
            return
        shard_idx, num_shards = _calc_shard_info(coordinate, spec)
        linear = int(_calc_shard_linear_idx(shard_idx, num_shards))
        base = int(torch.randint(0, 2**62, (), generator=generator))
        with torch.random.fork_rng(devices=[]):
            # The CPU generator alone: torch.manual_seed would reseed CUDA's too, which fork_rng([]) keeps.
            torch.default_generator.manual_seed((base + linear * _GOLDEN) & _MASK64)
            yield


def install_cpu_rng_tracker() -> None:
    """Make `CPUShardRNGTracker` DTensor's RNG tracker (process-wide), unless one for another device
    (CUDA's offset-based tracker) is already there."""
    from torch.distributed.tensor import _random

    current = _random._rng_tracker
    if current is None or isinstance(current, CPUShardRNGTracker):
        _random._rng_tracker = CPUShardRNGTracker()


class MeshGradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose inf/NaN verdict is the whole world's.

    It unscales all gradients of a device in one foreach op; on DTensor gradients that op reduces the
    verdict over the mesh of the FIRST gradient only. Under tensor parallel + FSDP the gradients live on
    two meshes (TP-sharded weights on ("dp_shard", "tp"), the rest on "dp_shard"): when the first is on
    "dp_shard", an overflow in one TP rank's shard was seen by its dp_shard group only, so half the ranks
    skipped the step and halved the scale while the others stepped, and the TP ranks of a group then
    trained different replicas with different loss scales. Here the verdicts are max-reduced over
    `group` (default: the world) after the unscale, as FSDP1's `ShardedGradScaler` does.
    """

    def __init__(self, device: str, group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, group: dist.ProcessGroup | None = None) -> MeshGradScaler:
        """A `MeshGradScaler` with `scaler`'s settings and state (scale, growth tracker)."""
        new = cls(
            scaler._device,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler.is_enabled(),
            group=group,
        )
        state = scaler.state_dict()
        if state:  # empty until the first scale()
            new.load_state_dict(state)
        return new

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if dist.is_available() and dist.is_initialized():
            # One flag per rank and call (one device per rank), so every rank joins the same collective;
            # a rank without gradients for this optimizer contributes a zero.
            flags = list(per_device.values()) or [torch.zeros_like(found_inf)]
            for flag in flags:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return per_device
