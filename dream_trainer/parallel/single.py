"""One process, one device: the models are used as they are."""

from __future__ import annotations

from dream_trainer.parallel.strategy import Strategy


class SingleDeviceStrategy(Strategy):
    """No wrapping, no process group; every collective returns its input."""

    name = "single"
