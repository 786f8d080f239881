"""The codecs on the logging path: dream_trainer's hand-written ones (before) against the libraries now used.

- CRC-32C (masked, as TFRecord framing stores it) of a 100-byte record (a scalar event) and of 1 MiB
  (an image event): the pure-Python table loop `dream_trainer.loggers.event_file` had, against
  `masked_crc32c` now (google-crc32c's C code).
- PNG encoding of a 256x256x3 uint8 image: the hand-written encoder `dream_trainer.utils.images` had
  (filter 0 on every scanline, `zlib.compress` at level 6), against `encode_png` now (Pillow, level 6,
  adaptive filters), on three 256x256x3 images: smooth (gradients and a disc), photo-like (the same with
  Gaussian noise of std 6, as camera images and a model's samples have) and uniform noise (the worst
  case: nothing to compress). Also reports the PNG sizes.

The old implementations are copied below as they were (the baseline), checked to agree with the new
ones, then each case is timed with `timeit` (best of `--repeat` runs of a number of calls chosen to take
about 0.2 s) and reported in microseconds per call, with the ratio before/after.

    python benchmarks/logging_codecs.py
    python benchmarks/logging_codecs.py --repeat 3   # quicker
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import struct
import sys
import timeit
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import google_crc32c
import numpy as np
import PIL
import torch
from PIL import Image

from dream_trainer.loggers.event_file import masked_crc32c
from dream_trainer.utils.images import encode_png


# --- the baseline: dream_trainer's code before it used the libraries, unchanged ----------------------
def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_TABLE = _crc32c_table()


def old_masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def old_encode_png(image: torch.Tensor) -> bytes:
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


# --- measuring ---------------------------------------------------------------------------------------
def per_call_us(fn: Callable[[], Any], repeat: int) -> float:
    """The best of `repeat` timings of a batch of calls sized to take about 0.2 s, per call, in µs."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()  # calls taking at least 0.2 s
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e6


def smooth_image(size: int) -> torch.Tensor:
    """A `size`x`size`x3 uint8 image of gradients and a disc, like a generated sample rather than noise."""
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    disc = ((x - 0.5) ** 2 + (y - 0.5) ** 2 < 0.1).float()
    rgb = torch.stack([x, y, 0.5 * disc + 0.25 * (1 - x)], dim=-1)
    return (rgb * 255).round().to(torch.uint8).contiguous()


def photo_like(smooth: torch.Tensor) -> torch.Tensor:
    """`smooth` with Gaussian noise of standard deviation 6 (of 255) added."""
    noise = torch.randn(smooth.shape, generator=torch.Generator().manual_seed(1)) * 6
    return (smooth.float() + noise).round().clamp(0, 255).to(torch.uint8)


def decoded(png: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(png))).copy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="timing runs per case; the best is kept")
    args = parser.parse_args()

    record = os.urandom(100)
    mib = os.urandom(1 << 20)
    noise = torch.randint(0, 256, (256, 256, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    smooth = smooth_image(256)
    photo = photo_like(smooth)
    pictures = {"smooth": smooth, "photo-like": photo, "noise": noise}

    # The baseline and the libraries agree before anything is timed.
    for data in (b"", record, mib[:4096]):
        assert old_masked_crc32c(data) == masked_crc32c(data)
    for image in pictures.values():
        assert torch.equal(decoded(old_encode_png(image)), image) and torch.equal(decoded(encode_png(image)), image)

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, Pillow {PIL.__version__}, "
        f"google-crc32c ({google_crc32c.implementation}), {platform.processor() or platform.machine()}",
        file=sys.stderr,
    )
    cases = [
        ("CRC-32C, 100-byte record", lambda: old_masked_crc32c(record), lambda: masked_crc32c(record)),
        ("CRC-32C, 1 MiB", lambda: old_masked_crc32c(mib), lambda: masked_crc32c(mib)),
    ]
    for name, image in pictures.items():
        cases.append((f"PNG encode 256x256x3, {name}", partial(old_encode_png, image), partial(encode_png, image)))
    print(f"{'case':<32} {'before (µs)':>13} {'after (µs)':>12} {'before/after':>13}")
    for name, before, after in cases:
        b, a = per_call_us(before, args.repeat), per_call_us(after, args.repeat)
        print(f"{name:<32} {b:>13,.1f} {a:>12,.1f} {b / a:>12,.1f}x", flush=True)
    for name, image in pictures.items():
        old, new = len(old_encode_png(image)), len(encode_png(image))
        print(f"PNG size 256x256x3, {name}: before {old:,} B, after {new:,} B ({new / old:.2f}x)")


if __name__ == "__main__":
    main()
