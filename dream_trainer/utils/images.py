"""Image helpers: tensors to uint8 HWC arrays, and PNG bytes (Pillow encodes them)."""

from __future__ import annotations

import io

import torch

_MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # channels -> Pillow mode: grey, RGB, RGBA


def to_uint8_images(images: torch.Tensor) -> torch.Tensor:
    """`(N, C, H, W)` or `(C, H, W)` floats in [0, 1] (or uint8) -> uint8 `(N, H, W, C)` on the CPU."""
    images = images.detach().cpu()
    if images.dim() == 2:
        images = images[None, None]
    elif images.dim() == 3:
        images = images[None]
    if images.dim() != 4 or images.shape[1] not in (1, 3, 4):
        raise ValueError(f"images must be (N, C, H, W) or (C, H, W) with C in 1, 3, 4; got shape {tuple(images.shape)}")
    if images.dtype != torch.uint8:
        images = (images.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return images.permute(0, 2, 3, 1).contiguous()


def encode_png(image: torch.Tensor) -> bytes:
    """PNG bytes of one uint8 `(H, W, C)` CPU image (C = 1 grey, 3 RGB, 4 RGBA), as `to_uint8_images` makes."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] not in _MODES:
        raise ValueError(
            f"encode_png needs a uint8 (H, W, C) image with C in 1, 3, 4; got {image.dtype} {tuple(image.shape)}"
        )
    # Imported here: a run that logs no images never loads Pillow (and its plugins).
    from PIL import Image

    h, w, c = image.shape
    buffer = io.BytesIO()
    Image.frombytes(_MODES[c], (w, h), image.numpy().tobytes()).save(buffer, format="PNG")
    return buffer.getvalue()
