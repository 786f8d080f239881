"""The `fault_tolerance` setting and the two exceptions of a fault-tolerant step (see the package docstring)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dream_trainer.errors import ConfigError, MisconfigurationError


class StepNotCommitted(Exception):
    """The step's quorum did not commit it (a participant failed or left): nothing of it is counted, and the
    same global samples are trained again by the next quorum. Raised at the commit point, caught by the step."""


class Rejoined(Exception):
    """This replica fell behind (it was stopped, or its step failed) and healed from a live peer in the middle of
    training: the loop starts again from the received state. Caught by `fit()`."""


@dataclass
class FaultToleranceConfig:
    """`DreamTrainerConfig.fault_tolerance`: per-step fault tolerance across replica groups (torchft).

    Every replica group runs the same script and config, each under its own `torchrun`, with its own
    `replica_id` and its own run directory (`root_dir` or `run_name`). See docs/fault-tolerance.md.
    """

    lighthouse: str | None = None
    """The torchft lighthouse, "http://host:port". None: the TORCHFT_LIGHTHOUSE environment variable."""
    replica_id: str | None = None
    """This replica group's name, unique among the groups (e.g. "0", "1", ...). None: the REPLICA_GROUP_ID
    environment variable."""
    min_replicas: int = 1
    """A step commits only when at least this many replica groups took part in it."""
    timeout_s: float = 60.0
    """Seconds a cross-group collective, the commit vote or a heal's transfer may take before the step is
    dropped (a stopped replica costs the others this long, once)."""
    quorum_timeout_s: float = 60.0
    """Seconds to wait for a quorum at a step's start."""
    hostname: str | None = None
    """The address the other groups reach this group's manager and heal server at. None: this host's name."""

    def __post_init__(self) -> None:
        name = "fault_tolerance"
        if self.min_replicas < 1 or isinstance(self.min_replicas, bool):
            raise ConfigError(f"{name}.min_replicas = {self.min_replicas!r} is invalid: expected an int >= 1.")
        for field_name in ("timeout_s", "quorum_timeout_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name}.{field_name} = {value!r} is invalid: expected seconds > 0.")
        for field_name in ("lighthouse", "replica_id", "hostname"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name}.{field_name} = {value!r} is invalid: expected a non-empty str or None.")

    def resolved(self) -> tuple[str, str]:
        """(lighthouse, replica_id), from the fields or the environment; a missing one is a `ConfigError`."""
        lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        replica = self.replica_id or os.environ.get("REPLICA_GROUP_ID")
        if not lighthouse:
            raise ConfigError(
                "fault_tolerance.lighthouse is not set and TORCHFT_LIGHTHOUSE is empty: give the lighthouse's "
                "address, e.g. FaultToleranceConfig(lighthouse='http://127.0.0.1:29510') (docs/fault-tolerance.md)."
            )
        if not replica:
            raise ConfigError(
                "fault_tolerance.replica_id is not set and REPLICA_GROUP_ID is empty: give each replica group its "
                "own id, e.g. FaultToleranceConfig(replica_id='0') (docs/fault-tolerance.md)."
            )
        return lighthouse, replica


def as_fault_tolerance(value: Any) -> FaultToleranceConfig | None:
    """The setting as a `FaultToleranceConfig` (a dict from a YAML config is converted); None: off."""
    if value is None or isinstance(value, FaultToleranceConfig):
        return value
    if isinstance(value, Mapping):
        known = set(FaultToleranceConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"fault_tolerance has unknown field(s) {unknown}: expected some of {sorted(known)}.")
        return FaultToleranceConfig(**dict(value))
    raise ConfigError(
        f"fault_tolerance = {value!r} is invalid: expected None (off), a FaultToleranceConfig or a dict of its fields."
    )


def check_fault_tolerance() -> None:
    """At construction, with the setting on: torchft is installed."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise MisconfigurationError(
            "fault_tolerance needs torchft: pip install 'dream-trainer[ft]' (torchft 0.2), or set fault_tolerance=None."
        )
