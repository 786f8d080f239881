"""Zip CRC-32s computed beside the write instead of inside torch's writer.

`torch.save` checksums every record on the thread that writes it, so on a large checkpoint the
CRC (a full pass over the data) runs after the copy into the page cache, never beside it. Here
torch writes with its checksums off, each large record is checksummed on a helper thread while
the writing thread copies the same bytes to the file, and the CRC fields (each record's data
descriptor and the central directory) are filled in at the end, from the page cache. The result
is byte for byte the file `torch.save` writes with its checksums on (the tests compare the two).
"""

from __future__ import annotations

import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dream_trainer.utils.durable_file import DurableFile

# Below this a record is checksummed inline: handing it to the helper costs more than the CRC.
_PARALLEL_BYTES = 1 << 20

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_LOCAL_SIG = 0x04034B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_CENTRAL_SIG = 0x02014B50
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_EOCD_SIG = 0x06054B50
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_ZIP64_LOCATOR_SIG = 0x07064B50
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_EOCD_SIG = 0x06064B50
_ZIP64_EXTRA_ID = 0x0001
_DATA_DESCRIPTOR_FLAG = 0x0008
_DESCRIPTOR_SIG = 0x08074B50  # at the start of a data descriptor (optional in the format; torch writes it)
_STORED = 0


class ZipCrcError(RuntimeError):
    """The file is not the zip archive torch writes (the caller falls back to torch's own CRCs)."""


class ChecksummingFile(DurableFile):
    """A `DurableFile` that checksums what is written, large writes on a helper thread.

    After `torch.save` (CRCs off) has written the archive, `fill_zip_crcs()` puts each record's
    CRC-32 where torch would have: its data descriptor and its central directory entry. Then
    `close()` makes the file durable.
    """

    def __init__(self, path: str | os.PathLike[str], writeback_bytes: int = 32 << 20) -> None:
        super().__init__(path, writeback_bytes)
        self._crcs: dict[int, tuple[int, int]] = {}  # file offset of a write -> (length, CRC-32)
        self._helper: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        offset = self._written
        if len(view) < _PARALLEL_BYTES:
            crc = zlib.crc32(view)
            done = super().write(view)
        else:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dream-crc")
            # Both halves release the GIL: the CRC runs on one core while the copy into the page
            # cache runs on another. The view is only valid during this call, so wait for it here.
            pending = self._helper.submit(zlib.crc32, view)
            try:
                done = super().write(view)
            finally:
                crc = pending.result()
        self._crcs[offset] = (len(view), crc)
        return done

    def _shutdown_helper(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def abort(self) -> None:
        self._shutdown_helper()
        super().abort()

    def close(self) -> None:
        self._shutdown_helper()
        super().close()

    def fill_zip_crcs(self) -> None:
        """Write the CRC-32 of every record into the archive's headers (before `close()`)."""
        self._shutdown_helper()
        fd, size = self._fd, self._written
        cd_offset, cd_size, entries = _central_directory(fd, size)
        cd = bytearray(_pread(fd, cd_size, cd_offset))
        pos = 0
        for _ in range(entries):
            fields = _CENTRAL.unpack_from(cd, pos)
            if fields[0] != _CENTRAL_SIG:
                raise ZipCrcError(f"no central directory entry at offset {cd_offset + pos}")
            flags, method, crc = fields[3], fields[4], fields[7]
            name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
            extra = bytes(cd[pos + 46 + name_len : pos + 46 + name_len + extra_len])
            comp_size, header_offset = _zip64_values(fields, extra)
            if method != _STORED:
                raise ZipCrcError(f"the record at offset {header_offset} is compressed")
            if crc == 0 and comp_size:
                data_offset = self._data_offset(fd, header_offset)
                crc = self._crc_of_record(fd, data_offset, comp_size)
                struct.pack_into("<I", cd, pos + 16, crc)
                field = self._crc_field(fd, flags, header_offset, data_offset + comp_size)
                os.pwrite(fd, struct.pack("<I", crc), field)
            pos += 46 + name_len + extra_len + comment_len
        os.pwrite(fd, cd, cd_offset)

    @staticmethod
    def _data_offset(fd: int, header_offset: int) -> int:
        local = _LOCAL.unpack(_pread(fd, _LOCAL.size, header_offset))
        if local[0] != _LOCAL_SIG:
            raise ZipCrcError(f"no local file header at offset {header_offset}")
        return header_offset + _LOCAL.size + local[9] + local[10]

    @staticmethod
    def _crc_field(fd: int, flags: int, header_offset: int, data_end: int) -> int:
        """Where the record's own copy of its CRC lives: the data descriptor after the data (torch
        writes one, signature first, for every record) or else the local header. A descriptor
        without its signature cannot be told from data: refuse it rather than guess."""
        if not flags & _DATA_DESCRIPTOR_FLAG:
            return header_offset + 14
        (first,) = struct.unpack("<I", _pread(fd, 4, data_end))
        if first != _DESCRIPTOR_SIG:
            raise ZipCrcError(f"no data descriptor signature at offset {data_end}")
        return data_end + 4

    def _crc_of_record(self, fd: int, data_offset: int, size: int) -> int:
        seen = self._crcs.get(data_offset)
        if seen is not None and seen[0] == size:
            return seen[1]
        # Written in pieces (not torch's way today): read it back; correct, only slower.
        crc, done = 0, 0
        while done < size:
            chunk = _pread(fd, min(size - done, 16 << 20), data_offset + done)
            crc = zlib.crc32(chunk, crc)
            done += len(chunk)
        return crc


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = os.pread(fd, n, offset)
    if len(out) != n:
        raise ZipCrcError(f"short read at offset {offset}: {len(out)} of {n} bytes")
    return out


def _central_directory(fd: int, size: int) -> tuple[int, int, int]:
    """(offset, size, number of entries) of the central directory; torch writes no archive comment."""
    if size < _EOCD.size:
        raise ZipCrcError("file too short for a zip archive")
    eocd = _EOCD.unpack(_pread(fd, _EOCD.size, size - _EOCD.size))
    if eocd[0] != _EOCD_SIG or eocd[7] != 0:
        raise ZipCrcError("no end-of-central-directory record at the end of the file")
    entries, cd_size, cd_offset = eocd[4], eocd[5], eocd[6]
    if 0xFFFF in (entries,) or 0xFFFFFFFF in (cd_size, cd_offset):
        start = size - _EOCD.size - _ZIP64_LOCATOR.size
        locator = _ZIP64_LOCATOR.unpack(_pread(fd, _ZIP64_LOCATOR.size, start))
        if locator[0] != _ZIP64_LOCATOR_SIG:
            raise ZipCrcError("zip64 end-of-central-directory locator missing")
        record = _ZIP64_EOCD.unpack(_pread(fd, _ZIP64_EOCD.size, locator[2]))
        if record[0] != _ZIP64_EOCD_SIG:
            raise ZipCrcError("zip64 end-of-central-directory record missing")
        entries, cd_size, cd_offset = record[7], record[8], record[9]
    return cd_offset, cd_size, entries


def _zip64_values(fields: tuple[int, ...], extra: bytes) -> tuple[int, int]:
    """(compressed size, local header offset) of a central directory entry, zip64 extra applied."""
    uncomp_size, comp_size, header_offset = fields[9], fields[8], fields[16]
    if 0xFFFFFFFF not in (uncomp_size, comp_size, header_offset):
        return comp_size, header_offset
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        if tag == _ZIP64_EXTRA_ID:
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, pos + 4))
            # Only the fields that overflowed are present, in this order.
            if uncomp_size == 0xFFFFFFFF:
                next(values)
            if comp_size == 0xFFFFFFFF:
                comp_size = next(values)
            if header_offset == 0xFFFFFFFF:
                header_offset = next(values)
            return comp_size, header_offset
        pos += 4 + length
    raise ZipCrcError("zip64 sizes announced but no zip64 extra field")
