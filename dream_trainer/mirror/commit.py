"""Commit markers: a checkpoint in the store is complete, and verifiable, once its marker exists.

A store without rename cannot publish a file atomically under its final name and a checkpoint may be many
objects (a sharded checkpoint's directory), so the mirror uploads every part first and then writes
`<checkpoint>.commit`, a small JSON object listing each part's key, size and CRC-32. A reader takes a checkpoint
only through its marker and checks every part against it; an upload cut at any byte leaves no marker (or an old
checkpoint's parts that no longer match it: the marker of a name written again is deleted before its new bytes
are sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MARKER = ".commit"
FORMAT = 1


@dataclass(frozen=True)
class Part:
    key: str  # relative to the mirror's URL
    size: int
    crc32: int


@dataclass(frozen=True)
class Commit:
    """A committed checkpoint: its key (relative to the mirror's URL: "<run>/checkpoints/<name>"), its parts,
    the checkpoint's local modification time when it was uploaded (a restored copy gets it back, so "last" orders
    runs and files as on the machine that wrote them) and the global step its name holds (-1: none)."""

    checkpoint: str
    parts: tuple[Part, ...]
    mtime: float
    is_dir: bool

    @property
    def run(self) -> str:
        return self.checkpoint.split("/", 1)[0]

    @property
    def marker(self) -> str:
        return self.checkpoint + MARKER

    def encode(self) -> bytes:
        return json.dumps(
            {"format": FORMAT, "checkpoint": self.checkpoint, "is_dir": self.is_dir, "mtime": self.mtime,
             "parts": [{"key": p.key, "size": p.size, "crc32": p.crc32} for p in self.parts]},
            indent=1,
        ).encode()  # fmt: skip

    @classmethod
    def decode(cls, marker: str, data: bytes) -> Commit:
        """The marker at key `marker`; `ValueError` when it is not one this version wrote (or is damaged)."""
        raw: Any = json.loads(data)
        checkpoint = marker[: -len(MARKER)]
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("checkpoint") != checkpoint:
            raise ValueError(f"{marker}: not a commit marker of format {FORMAT} for {checkpoint}")
        parts = tuple(Part(str(p["key"]), int(p["size"]), int(p["crc32"])) for p in raw["parts"])
        if not parts or any(not (p.key == checkpoint or p.key.startswith(checkpoint + "/")) for p in parts):
            raise ValueError(f"{marker}: its parts are not under {checkpoint}")
        return cls(checkpoint, parts, float(raw["mtime"]), bool(raw["is_dir"]))
