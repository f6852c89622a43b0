"""Writing a program's weights to disk past the kernel's page cache.

An export writes every weight at least once: ONNX external data, the ``.pte``, and for a
bfloat16 checkpoint exported to ExecuTorch in float32 also the temporary file its converted
weights map (:mod:`~hfexport.targets.executorch.stored_weights`). Written with ``write``, each
byte is copied into a page-cache page the kernel allocates for it, and that copy was the largest
single cost of an export: a fifth of the CPU time of a Llama-3.2-1B-shaped float32 export to
ExecuTorch (``copy_folio_from_iter_atomic`` in ``perf``, 16.5 of 68 s), and 4.6 to 12 s of
system time per 5 GiB written on the 2-core CI machine. With ``O_DIRECT`` the disk reads the
bytes from the writer's own buffer instead: 0.2 s of system time for the same 5 GiB.

:class:`DirectStream` writes one run of bytes from a file's current position through a
page-aligned staging buffer: whole 4 KiB blocks with ``O_DIRECT``, the partial block at its end
through the page cache. Where the file system refuses ``O_DIRECT`` (or off Linux),
:func:`direct_stream` returns None and the caller writes as before.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from typing import Any

import torch

# the unit O_DIRECT transfers in: a file offset, a length and a buffer address must be multiples
# of the device's logical block (512 bytes or 4 KiB); a page is a multiple of both
BLOCK = mmap.PAGESIZE
# below this a weight is written through the page cache: opening a second descriptor and reading
# the partial block before it back costs more than the copy saves
_DIRECT_MIN_BYTES = 1 << 20
# a stage for a stream of many writes
STAGE_BYTES = 64 << 20
# what :meth:`DirectStream.write_from` reads at a time
_SCRATCH_BYTES = 8 << 20


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of ``nbytes`` (anonymous memory; O_DIRECT needs an aligned buffer)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]


def direct_descriptor(fd: int, flags: int = os.O_RDWR) -> int | None:
    """A second descriptor of the file ``fd`` is open on, with ``O_DIRECT`` (its own offset), or
    None where the system or the file system has none."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct or not sys.platform.startswith("linux"):
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | o_direct)
    except OSError:
        return None


def read_direct(fd: int, into: memoryview, offset: int) -> int:
    """Read ``len(into)`` bytes (fewer at the end of the file) at ``offset`` of the O_DIRECT
    descriptor ``fd`` into the page-aligned ``into``; the offset and length are whole blocks."""
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class DirectStream:
    """Bytes written from ``file``'s position onward, through ``stage`` (a page-aligned buffer
    the caller reuses), the whole blocks of them with ``O_DIRECT`` on ``direct`` (a second
    descriptor of the same file). The block the stream starts in is read back first, so it can be
    written whole. :meth:`close` writes the last partial block through ``file`` and leaves its
    position at the stream's end. Nothing else writes to ``file`` until then."""

    def __init__(self, file: Any, direct: int, stage: torch.Tensor) -> None:
        file.flush()
        self.file, self.direct, self.stage = file, direct, stage
        self.refused = False  # O_DIRECT refused a write: the rest goes through the page cache
        self._scratch: torch.Tensor | None = None
        start = file.tell()
        head = start % BLOCK
        self.base = start - head  # the file offset of stage[0]
        self.filled = head
        if head:
            view = memoryview(stage.numpy())
            got = read_direct(direct, view[:BLOCK], self.base)
            view[got:head] = bytes(max(0, head - got))  # past the end of the file: a hole, zeros

    @property
    def room(self) -> int:
        """The most bytes one :meth:`tensor` can take."""
        return len(self.stage) - 2 * BLOCK

    def fits(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether :meth:`tensor` can give room for ``nbytes`` of ``dtype``: at most :attr:`room`
        bytes, and the stream's position a multiple of the dtype's size."""
        return nbytes <= self.room and self.filled % dtype.itemsize == 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Free staging room for a row-major tensor of ``shape`` and ``dtype`` (:meth:`fits`),
        to fill and then :meth:`advance` past."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not self.fits(nbytes, dtype):
            raise ValueError(f"{nbytes} bytes of {dtype} do not fit the stage at byte {self.filled}")
        if self.filled + nbytes > len(self.stage):
            self._write_blocks()
        return self.stage[self.filled : self.filled + nbytes].view(dtype).view(shape)

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` of staging room filled (after :meth:`tensor`)."""
        self.filled += nbytes

    def write(self, data: Any) -> int:
        """Write ``data`` (any buffer)."""
        view = memoryview(data).cast("B")
        stage = memoryview(self.stage.numpy())
        done = 0
        while done < len(view):
            if self.filled == len(self.stage):
                self._write_blocks()
            count = min(len(view) - done, len(self.stage) - self.filled)
            stage[self.filled : self.filled + count] = view[done : done + count]
            self.filled += count
            done += count
        return len(view)

    def write_from(self, source: int, offset: int, nbytes: int) -> None:
        """Write ``nbytes`` read at ``offset`` (a whole block) of ``source``, an O_DIRECT
        descriptor of another file padded to whole blocks: neither file's pages pass through the
        page cache."""
        if self._scratch is None:
            self._scratch = aligned_empty(_SCRATCH_BYTES)
        buffer = memoryview(self._scratch.numpy())
        done = 0
        while done < nbytes:
            want = min(len(buffer), -(-(nbytes - done) // BLOCK) * BLOCK)
            got = read_direct(source, buffer[:want], offset + done)
            if got < min(want, nbytes - done):
                raise OSError(errno.EIO, f"read {got} of {want} bytes at {offset + done} of a weights file")
            self.write(buffer[: min(got, nbytes - done)])
            done += min(got, nbytes - done)

    def _write_blocks(self) -> None:
        whole = self.filled - self.filled % BLOCK
        view = memoryview(self.stage.numpy())
        written = 0
        while written < whole:
            if not self.refused:
                try:
                    written += os.pwrite(self.direct, view[written:whole], self.base + written)
                    continue
                except OSError as error:
                    if error.errno != errno.EINVAL:
                        raise
                    # the device wants blocks larger than a page: the rest through the page cache
                    self.refused = True
            written += os.pwrite(self.file.fileno(), view[written:whole], self.base + written)
        rest = self.filled - whole
        view[:rest] = view[whole : self.filled]
        self.base += whole
        self.filled = rest

    def __enter__(self) -> DirectStream:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            os.close(self.direct)  # what was written stays, as a failed write() leaves it

    def close(self) -> None:
        """Write what is left and close the O_DIRECT descriptor; ``file``'s position is then the stream's end."""
        try:
            self._write_blocks()
            view = memoryview(self.stage.numpy())
            written = 0
            while written < self.filled:
                written += os.pwrite(self.file.fileno(), view[written : self.filled], self.base + written)
            self.file.seek(self.base + self.filled)
        finally:
            os.close(self.direct)


def direct_stream(file: Any, stage: torch.Tensor, nbytes: int | None = None) -> DirectStream | None:
    """A :class:`DirectStream` from ``file``'s position through ``stage``, or None when the page
    cache should take the ``nbytes`` to come (None: many): fewer than a mebibyte, ``file`` not an
    OS file, or no O_DIRECT."""
    if nbytes is not None and nbytes < _DIRECT_MIN_BYTES:
        return None
    try:
        fd = file.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    direct = direct_descriptor(fd)
    return DirectStream(file, direct, stage) if direct is not None else None
