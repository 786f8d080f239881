"""ImageFileLogger: images from `trainer.log_images` saved as PNG files."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from dream_trainer.loggers.base import Logger
from dream_trainer.utils.images import encode_png


class ImageFileLogger(Logger):
    """Saves each image passed to `trainer.log_images(tag, images)` as
    `<save_dir>/<tag>/step=<step>-<i>.png`; at most `max_images` per call. Metrics are ignored.

    Args:
        save_dir: directory (default: `<trainer.log_dir>/images`).
        max_images: images kept from each call.
    """

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, max_images: int = 8) -> None:
        self.log_dir = Path(save_dir) if save_dir is not None else None
        self.max_images = max_images

    def attach(self, log_dir: Path) -> None:
        if self.log_dir is None:
            self.log_dir = Path(log_dir) / "images"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_images(self, tag: str, images: torch.Tensor, step: int) -> None:
        assert self.log_dir is not None, "ImageFileLogger has no directory: pass save_dir or attach it to a trainer"
        folder = self.log_dir / re.sub(r"[^\w.-]+", "_", tag)
        folder.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images[: self.max_images]):
            (folder / f"step={step}-{i}.png").write_bytes(encode_png(img))
