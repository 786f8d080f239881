"""A checkpoint is verified before it is trusted: its bytes, its sections, its weights.

- **Bytes.** `torch.save` writes a zip archive with a CRC-32 record per member (the pickled index
  `data.pkl`, one member per tensor storage), and `torch.load` never checks them. `verify_bytes` reads
  every member once and compares, before anything in the file is unpickled: one flipped bit anywhere in
  the data fails. A file written with `checkpoint_crc32=False` has no records (every CRC field is 0): its
  bytes cannot be checked, which is said once per file.
- **Sections.** The trainer's header (`state["dream_trainer"]`) lists the top-level sections the file was
  written with (`"sections"`); every one must be there. A file of an earlier version, without the list,
  must hold the sections every version wrote (`counters`, and `models` for a checkpoint file).
- **Weights.** Every floating-point tensor under `models` and `optimizers` is finite.

A failure is a `DamagedCheckpoint` naming the file and the part. Finding a damaged member's tensor reads
the file's index with an unpickler that builds nothing but plain containers and names (run only after a
failure).
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch

from dream_trainer.errors import CheckpointError
from dream_trainer.utils.warn import warn_user

_CHUNK = 1 << 24  # bytes read per CRC update
# Sections every version of the trainer wrote (a file without the header's "sections" list is older).
_ALWAYS_WRITTEN = ("counters",)


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose bytes, sections or weights failed verification. `path` is the file, `part`
    the piece that failed, in words (a tensor's name, a section, the archive's index)."""

    def __init__(self, path: Path, part: str, what: str, hint: str = "") -> None:
        self.path = path
        self.part = part
        self.what = what
        tail = f"; {hint}" if hint else ""
        super().__init__(f"checkpoint {str(path)!r} is damaged: {part}: {what}{tail}")


def verify_bytes(path: Path) -> bool:
    """Compare every zip member of `path` with its CRC-32 record. True when verified, False when the
    file holds no records to compare (written with `checkpoint_crc32=False`). Raises `DamagedCheckpoint`
    naming the damaged member's tensor.

    The members' bytes are read and summed in 16 MiB pieces on several threads (`zlib.crc32` and
    `os.pread` release the GIL) and each member's pieces are combined, so a large checkpoint is verified
    at the speed of several cores rather than one."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if not members:
                raise DamagedCheckpoint(path, "the archive", "it holds no members")
            if all(info.CRC == 0 for info in members):
                return False  # torch wrote it without checksums: nothing to compare against
            with open(path, "rb") as f:
                spans = [_data_span(path, f, info) for info in members]
                crcs = _crcs(f.fileno(), spans)
            for info, crc in zip(members, crcs, strict=True):
                if crc != info.CRC:
                    raise DamagedCheckpoint(path, _member_part(archive, info.filename), "its CRC-32 does not match")
    except DamagedCheckpoint:
        raise
    except zipfile.BadZipFile as exc:
        raise DamagedCheckpoint(path, "the archive's structure", f"it cannot be read as a zip archive ({exc})") from exc
    except (OSError, EOFError, ValueError) as exc:
        raise DamagedCheckpoint(path, "the archive", f"it is truncated or unreadable ({exc})") from exc
    return True


def _data_span(path: Path, f: IO[bytes], info: zipfile.ZipInfo) -> tuple[int, int]:
    """Where `info`'s bytes are: (offset, length), after its local header, which must name it (as
    `zipfile` checks). torch stores its members uncompressed."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise DamagedCheckpoint(
            path, f"the archive's record {info.filename!r}", "it is compressed (torch.save never is)"
        )
    f.seek(info.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise DamagedCheckpoint(path, "the archive's structure", f"no local header for {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    if f.read(name_len) != info.orig_filename.encode():
        raise DamagedCheckpoint(path, "the archive's structure", f"the local header of {info.filename!r} names another")
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def _crcs(fd: int, spans: list[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each span of the file `fd`: pieces summed on up to 8 threads, then combined."""
    pieces = [(m, start, min(_CHUNK, end - start)) for m, (off, n) in enumerate(spans) for start, end in _cuts(off, n)]

    def crc_of(piece: tuple[int, int, int]) -> int:
        _, start, length = piece
        data = os.pread(fd, length, start)
        if len(data) != length:
            raise EOFError(f"{length - len(data)} bytes missing at offset {start + len(data)}")
        return zlib.crc32(data)

    total = sum(n for _, n in spans)
    workers = min(8, os.cpu_count() or 1, len(pieces)) if total > 4 * _CHUNK else 1
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dream-verify") as pool:
            piece_crcs = list(pool.map(crc_of, pieces))
    else:
        piece_crcs = [crc_of(piece) for piece in pieces]
    crcs = [0] * len(spans)
    for (m, _, length), crc in zip(pieces, piece_crcs, strict=True):
        crcs[m] = crc32_combine(crcs[m], crc, length)
    return crcs


def _cuts(offset: int, length: int) -> list[tuple[int, int]]:
    return [(start, offset + length) for start in range(offset, offset + length, _CHUNK)]


# crc32_combine (zlib's, which Python's zlib does not expose): the CRC of `a + b` from crc(a), crc(b) and
# len(b). Appending n zero bytes to a message is a linear map of its CRC over GF(2); the maps for 2**k
# bytes are kept (`_ZEROS[k]`, a 32x32 bit matrix as 32 columns) and applied for each bit of n.
def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, column) for column in matrix]


_ONE_ZERO_BIT = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]  # the CRC-32 polynomial, reflected
_ZEROS = [_gf2_square(_gf2_square(_gf2_square(_ONE_ZERO_BIT)))]  # one zero byte (8 bits); then 2, 4, ... bytes


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """`zlib.crc32(a + b)` from `crc1 = zlib.crc32(a)`, `crc2 = zlib.crc32(b)` and `length2 = len(b)`."""
    k = 0
    while length2:
        if k == len(_ZEROS):
            _ZEROS.append(_gf2_square(_ZEROS[-1]))
        if length2 & 1:
            crc1 = _gf2_times(_ZEROS[k], crc1)
        length2 >>= 1
        k += 1
    return crc1 ^ crc2


def _member_part(archive: zipfile.ZipFile, name: str) -> str:
    """A damaged zip member in words: the index itself, or the tensor(s) whose storage it holds."""
    top, _, rest = name.partition("/")
    if rest == "data.pkl":
        return "the archive's index (data.pkl)"
    if not rest.startswith("data/"):
        return f"the archive's record {rest or name!r}"
    key = rest[len("data/") :]
    try:
        names = _tensors_of_storage(archive.read(f"{top}/data.pkl"), key)
    except Exception:  # the index is unreadable too: the member's name is all there is
        names = []
    size = archive.getinfo(name).file_size
    where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"tensor {where}, {size} bytes" if where else f"tensor storage {key}, {size} bytes"


class _Names(pickle.Unpickler):
    """Reads a checkpoint's index into plain containers, each tensor replaced by its storage's key:
    no class named in the file is imported or called."""

    def persistent_load(self, pid: Any) -> Any:
        return ("storage", str(pid[2])) if isinstance(pid, tuple) and len(pid) > 2 else ("storage", "?")

    def find_class(self, module: str, name: str) -> Any:
        if name.startswith("_rebuild_"):  # torch._utils' tensor and parameter rebuilders
            return _storage_of
        if (module, name) == ("collections", "OrderedDict"):
            return _Dict
        return _opaque


class _Dict(dict):  # a state dict's OrderedDict, with its `_metadata` attribute
    pass


class _StorageRef:
    def __init__(self, key: str) -> None:
        self.key = key


def _storage_of(*args: Any) -> Any:
    """The storage a rebuilt tensor (or parameter, or tensor subclass) stands on: the first found in
    its arguments."""
    for arg in args:
        if isinstance(arg, _StorageRef):
            return arg
        if isinstance(arg, tuple) and arg[:1] == ("storage",):
            return _StorageRef(arg[1])
        if isinstance(arg, tuple):
            found = _storage_of(*arg)
            if isinstance(found, _StorageRef):
                return found
    return _Opaque()


def _opaque(*_args: Any, **_kwargs: Any) -> Any:
    return _Opaque()


class _Opaque:
    def __setstate__(self, _state: Any) -> None:
        pass


def _tensors_of_storage(index: bytes, key: str) -> list[str]:
    import io

    tree = _Names(io.BytesIO(index)).load()
    return [path for path, ref in _walk(tree, "") if isinstance(ref, _StorageRef) and ref.key == key]


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (list, tuple)) and not isinstance(node, _StorageRef):
        for i, v in enumerate(node):
            yield from _walk(v, f"{prefix}.{i}")
    else:
        yield prefix, node


def verify_sections(path: Path, state: dict[str, Any], with_tensors: bool) -> None:
    """Every section the header lists is present (an older file without the list: the sections every
    version wrote). `with_tensors`: a checkpoint file (models and optimizers inside), not a sharded
    checkpoint's `trainer_state.pt`."""
    header = state.get("dream_trainer")
    if header is None:
        return  # not written by the trainer (a user's own dict): load_state_dict says what it lacks
    if not isinstance(header, Mapping):
        raise DamagedCheckpoint(path, "section 'dream_trainer'", f"it holds a {type(header).__name__}, not the header")
    listed = header.get("sections")
    expected = list(listed) if isinstance(listed, (list, tuple)) else [*_ALWAYS_WRITTEN, *(["models"] * with_tensors)]
    missing = [s for s in expected if s not in state]
    if missing:
        written = "the file was written with it" if listed is not None else "every checkpoint the trainer writes has it"
        raise DamagedCheckpoint(
            path, f"section {missing[0]!r}" + (f" (and {missing[1:]})" if missing[1:] else ""), f"missing; {written}"
        )


def verify_finite(path: Path, state: Mapping[str, Any]) -> None:
    """Every floating-point tensor of the models and optimizers is finite."""
    for group in ("models", "optimizers"):
        for name, tensor in _walk(state.get(group) or {}, group):
            if isinstance(tensor, torch.Tensor) and not _finite(tensor):
                raise DamagedCheckpoint(
                    path,
                    f"tensor {name}",
                    "it holds NaN or infinite values",
                    "resume from an earlier checkpoint; to inspect this one, torch.load(path, weights_only=True)",
                )


def _finite(tensor: torch.Tensor) -> bool:
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return True
    try:
        # A sum is finite only if every element is (NaN and inf propagate), and costs a tenth of
        # isfinite(); 16-bit values are summed in float32, which they cannot overflow as easily.
        total = tensor.sum(dtype=torch.float32) if tensor.itemsize <= 2 and tensor.is_floating_point() else tensor.sum()
        if bool(torch.isfinite(total)):
            return True
    except RuntimeError:  # a dtype without a sum (float8): checked element-wise below
        pass
    # A large finite tensor can still overflow its sum: a non-finite sum is checked element-wise.
    return bool(torch.isfinite(tensor.float() if tensor.itemsize == 1 else tensor).all())


_told_unverified: set[Path] = set()


def note_unverified(path: Path) -> None:
    """Say once per file that its bytes could not be verified (no CRC-32 records)."""
    if path in _told_unverified:
        return
    _told_unverified.add(path)
    warn_user(
        f"checkpoint {str(path)!r} has no CRC-32 records (written with checkpoint_crc32=False): its sections and "
        "weights were checked, its bytes could not be; keep checkpoint_crc32=True for files that are verified whole"
    )
