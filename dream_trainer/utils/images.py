"""Image helpers: tensors to uint8 HWC arrays and PNG bytes (no imaging library needed)."""

from __future__ import annotations

import struct
import zlib

import torch


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
    """PNG bytes of one uint8 `(H, W, C)` image (C = 1 grey, 3 RGB, 4 RGBA)."""
    h, w, c = image.shape
    color_type = {1: 0, 3: 2, 4: 6}[c]
    raw = image.numpy().tobytes()
    stride = w * c
    scanlines = b"".join(b"\x00" + raw[i * stride : (i + 1) * stride] for i in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(scanlines)) + chunk(b"IEND", b"")
    )
