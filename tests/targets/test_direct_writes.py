"""Weights written to disk past the page cache (``hfexport.direct_writes``): the bytes are the
ones a plain ``write`` gives, and the file's pages are not left in the page cache."""

import ctypes
import errno
import hashlib
import mmap
import os

import numpy
import pytest
import torch

from hfexport import direct_writes
from hfexport.precision import buffers_reused, write_converted


def _o_direct_here() -> bool:
    import tempfile

    with tempfile.TemporaryFile() as file:
        fd = direct_writes.direct_descriptor(file.fileno())
        if fd is not None:
            os.close(fd)
        return fd is not None


pytestmark = pytest.mark.skipif(not _o_direct_here(), reason="no O_DIRECT on the temporary directory's file system")


def _resident_pages(path) -> int:
    """How many of ``path``'s pages are in the page cache (``mincore``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) as mapping:
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        address = numpy.frombuffer(mapping, dtype=numpy.uint8).ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0, ctypes.get_errno()
        return sum(byte & 1 for byte in vector)


def _o_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("reused", [False, True])
@pytest.mark.parametrize(
    ("shape", "transposed", "before"),
    [((1024, 2048), False, 0), ((1024, 2048), True, 4098), ((1500, 576), False, 6), ((576, 1500), True, 3)],
)
def test_a_converted_weight_goes_to_disk_past_the_page_cache_with_the_bytes_a_plain_write_gives(
    tmp_path, shape, transposed, before, reused
):
    """``write_converted`` writes a weight (8 MiB in float32; row-major or transposed; at any
    position in a file, after bytes written through the page cache) with O_DIRECT: the file holds
    what converting it whole gives, between what came before and after, the digest is the SHA-256
    of the weight's own bytes, row-major, and of the weight's pages only the last, partly written
    one is in the page cache (a plain ``write`` leaves them all there)."""
    torch.manual_seed(0)
    source = torch.randn(*shape).to(torch.bfloat16)
    source = source.t() if transposed else source
    want = source.to(torch.float32).contiguous().numpy().tobytes()
    path = tmp_path / "weights.bin"
    digest = hashlib.sha256()
    with open(path, "wb") as file, buffers_reused() if reused else open(os.devnull) as _:
        file.write(b"h" * before)
        write_converted(source, torch.float32, file, digest)
        file.write(b"tail")
    resident = _resident_pages(path)  # before reading it back
    data = path.read_bytes()
    assert data[:before] == b"h" * before and data[-4:] == b"tail"
    assert data[before:-4] == want
    assert digest.hexdigest() == hashlib.sha256(source.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    # the pages wholly before the weight's were written through the page cache, by plain writes
    written_before = before // mmap.PAGESIZE
    assert resident <= written_before + 1, f"{resident} of {-(-len(data) // mmap.PAGESIZE)} pages in the page cache"


def test_a_device_refusing_o_direct_writes_gets_them_through_the_page_cache(tmp_path, monkeypatch):
    """When an O_DIRECT write fails with EINVAL (a device whose blocks are larger than a page),
    the stream writes the rest through the page cache: the bytes are the same."""
    pwrite = os.pwrite
    refused = []

    def refusing(fd, data, offset):
        if _o_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    source = torch.randn(2048, 1024).to(torch.bfloat16)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as file:
        file.write(b"x" * 100)
        write_converted(source, torch.float32, file)
    assert len(refused) == 1
    assert path.read_bytes() == b"x" * 100 + source.to(torch.float32).numpy().tobytes()


def test_a_stream_copies_another_files_blocks_past_the_page_cache(tmp_path):
    """``DirectStream.write_from`` copies a range of another file (read with O_DIRECT) between
    bytes written from memory."""
    source_path = tmp_path / "source.bin"
    payload = os.urandom(3 * mmap.PAGESIZE + 100)
    source_path.write_bytes(payload + bytes(-len(payload) % mmap.PAGESIZE))  # padded to whole blocks
    os.sync()
    reader = os.open(source_path, os.O_RDONLY | os.O_DIRECT)
    try:
        path = tmp_path / "out.bin"
        with open(path, "wb") as file:
            stream = direct_writes.direct_stream(file, direct_writes.aligned_empty(1 << 20))
            assert stream is not None
            with stream:
                stream.write(b"head")
                stream.write_from(reader, mmap.PAGESIZE, len(payload) - mmap.PAGESIZE)
                stream.write(b"end")
            file.write(b"!")
    finally:
        os.close(reader)
    assert path.read_bytes() == b"head" + payload[mmap.PAGESIZE :] + b"end!"
