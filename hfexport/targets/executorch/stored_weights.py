"""Weights the model stores narrower than it computes in, converted for the ``.pte`` one at a time.

The command line exports a bfloat16 checkpoint to ExecuTorch in float32 (XNNPACK runs no
bfloat16). Converted whole before the capture, a Llama-3.2-1B-shaped checkpoint's export held
its float32 weights from the capture to the save (5.3 GiB peak, against ONNX Runtime GenAI's
builder's 5.0, which converts a layer at a time); a 3B one would hold 12 GiB. Instead the model
keeps its linear layers' weights as read and computes in float32
(:class:`~hfexport.computed_weights.ComputedIn`, for :meth:`ExecutorchTarget.keeps_stored`), so the
captured program casts each stored weight. The ``stored_weights_as_float32`` pass
(:func:`stored_weights_converted`) folds each cast into a float32 weight, written converted a slice
at a time into an unlinked temporary file the program's tensors then map read-only: their values
are real, and the pages a reader touches are handed back to the kernel once read
(:func:`pages_released`), so the process holds about one float32 weight at a time. The file is
written past the page cache (:mod:`~hfexport.direct_writes`), the key XNNPACK names each weight by
taken on the way (:func:`known_key`), and the ``.pte`` writer
copies each weight from the file past the page cache too (:func:`direct_place`). Where the
temporary directory is memory (tmpfs) or short of room, the weights are converted in memory, as
before.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import shutil
import sys
import tempfile
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from hfexport.direct_writes import direct_descriptor
from hfexport.precision import buffers_reused, write_converted

logger = logging.getLogger("hfexport")


class _Reader:
    """An O_DIRECT descriptor of the temporary file, closed when no tensor maps the file any more."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        weakref.finalize(self, os.close, fd)


class _Spilled(NamedTuple):
    """Where a converted weight is: its mapping of the temporary file, its place in it, the key
    XNNPACK names it by, and a descriptor that reads the file past the page cache (or None)."""

    mapping: mmap.mmap
    offset: int
    nbytes: int
    key: str
    reader: _Reader | None


# each live tensor mapping the temporary file, by id
_MAPPED: dict[int, _Spilled] = {}
# what a strict capture asserts of each weight it reads, its old dtype among it
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
# room left beside the spilled weights in the temporary directory
_SPARE_BYTES = 1 << 30


def _is_stored_cast(node: torch.fx.Node, weight: torch.Tensor) -> bool:
    """``node`` converts ``weight`` (a placeholder's value) to a row-major float32 tensor of its shape."""
    name = getattr(node.target, "__name__", str(node.target))
    value = node.meta.get("val")
    return (
        node.op == "call_function"
        and name.split(".")[-2:] in (["to", "dtype"], ["_to_copy", "default"])
        and isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and tuple(value.shape) == tuple(weight.shape)
        and value.is_contiguous()
    )


def stored_weights_converted(program: torch.export.ExportedProgram) -> int:
    """Fold each parameter of ``program`` that is read only through casts to float32 (a weight
    the model stores in bfloat16 or float16 and computes in float32) into a float32 parameter of
    the same name, and return how many were. The new tensors map a temporary file
    (:func:`_spill_directory`), else are converted in memory. The old tensors (the model's own)
    are not changed; the command line's model lets them go after the ``fx_passes`` stage, as it
    does any weight a pass dropped."""
    parameters = program.graph_signature.inputs_to_parameters
    folded: list[tuple[torch.fx.Node, str, torch.Tensor, list[torch.fx.Node]]] = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in parameters:
            continue
        value = program.state_dict.get(parameters[node.name])
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.bfloat16, torch.float16):
            continue
        casts = [user for user in node.users if user.target is not _ASSERT_METADATA]
        if casts and all(_is_stored_cast(user, value) for user in casts):
            folded.append((node, parameters[node.name], value, casts))
    if not folded:
        return 0
    sources = [value for _, _, value, _ in folded]
    # a program copied for one more target (a shared capture's) shares its state_dict
    program._state_dict = dict(program.state_dict)
    for (node, target, _, casts), converted in zip(folded, _converted(sources), strict=True):
        node.meta["val"] = casts[0].meta["val"]
        for user in list(node.users):
            user.replace_all_uses_with(node)  # a cast's users; an assertion of the old dtype has none
            program.graph.erase_node(user)
        program.state_dict[target] = converted
    program.graph_module.recompile()
    return len(folded)


def _converted(sources: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """``sources`` in float32, as parameters: mapping one temporary file, else in memory."""
    page = mmap.PAGESIZE
    offsets, size = [], 0
    for source in sources:
        offsets.append(size)
        size += -(-source.numel() * 4 // page) * page
    directory = _spill_directory(size)
    if directory is None:
        return [torch.nn.Parameter(source.to(torch.float32), requires_grad=False) for source in sources]
    digests = []
    with tempfile.TemporaryFile(dir=directory) as file, buffers_reused():
        for source, offset in zip(sources, offsets, strict=True):
            file.seek(offset)
            digest = hashlib.sha256(_converted_key_prefix(source.dtype))
            write_converted(source, torch.float32, file, digest)
            digests.append(digest.hexdigest())
        file.truncate(size)
        file.flush()
        mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)
        direct = direct_descriptor(file.fileno(), os.O_RDONLY)
    reader = _Reader(direct) if direct is not None else None
    converted = []
    with warnings.catch_warnings():
        # read-only on purpose: a write into a weight would fault, not reach the file
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for source, offset, key in zip(sources, offsets, digests, strict=True):
            tensor = torch.frombuffer(mapping, dtype=torch.float32, count=source.numel(), offset=offset)
            parameter = torch.nn.Parameter(tensor.view(source.shape), requires_grad=False)
            _MAPPED[id(parameter)] = _Spilled(mapping, offset, source.numel() * 4, key, reader)
            weakref.finalize(parameter, _MAPPED.pop, id(parameter), None)
            converted.append(parameter)
    logger.info("converted %d stored weights to float32 in %s (%.0f MiB)", len(sources), directory, size / 2**20)
    return converted


def _converted_key_prefix(dtype: torch.dtype) -> bytes:
    """What the SHA-256 XNNPACK keys a converted weight by starts with, before the weight's bytes
    as stored (``dtype``): the key names the float32 bytes those convert to exactly. XNNPACK's own
    key, the SHA-256 of the float32 bytes, took twice as long to hash (Llama-3.2-1B's shape: 2.2 s
    of the export's CPU for 4.6 GB); a key only has to name one content, since the runtime shares
    a packed weight between programs by its key."""
    return f"hfexport: float32 of {str(dtype).removeprefix('torch.')}\0".encode()


def _spill_directory(size: int) -> str | None:
    """The temporary directory, when it is on a disk (not memory: tmpfs, ramfs) with ``size``
    bytes to spare and more; None elsewhere and off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    directory = tempfile.gettempdir()
    try:
        if shutil.disk_usage(directory).free < size + _SPARE_BYTES:
            logger.info("converting stored weights in memory: %s has no room for %d MiB", directory, size >> 20)
            return None
        filesystem = _filesystem(os.path.realpath(directory))
    except OSError:
        return None
    if filesystem in (None, "tmpfs", "ramfs"):
        logger.info("converting stored weights in memory: %s is on %s", directory, filesystem)
        return None
    return directory


def _filesystem(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    best, kind = "", None
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            above = path == point or path.startswith(point.rstrip("/") + "/")
            if above and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def pages_released(tensor: torch.Tensor) -> None:
    """Hand the pages of ``tensor``'s storage back to the kernel when it maps the temporary file
    (read again from it if touched again): the process stops counting a weight once read. Any
    other tensor is left alone."""
    place = _MAPPED.get(id(tensor))
    if place is not None:
        place.mapping.madvise(mmap.MADV_DONTNEED, place.offset, place.nbytes)


def mapped(tensor: Any) -> bool:
    """Whether ``tensor`` maps the temporary file of :func:`stored_weights_converted`."""
    return id(tensor) in _MAPPED


def known_key(tensor: Any) -> str | None:
    """The key XNNPACK names ``tensor``'s bytes by when it maps the temporary file: a SHA-256
    (hex) of the bytes it was converted from (:func:`_converted_key_prefix`), taken as they were
    written (the mapping is read-only: they cannot have changed)."""
    place = _MAPPED.get(id(tensor))
    return place.key if place is not None else None


def direct_place(tensor: Any) -> tuple[int, int, int] | None:
    """An O_DIRECT descriptor of the temporary file ``tensor`` maps, its offset there and its
    size in bytes: to copy it past the page cache (:meth:`~hfexport.direct_writes.DirectStream.write_from`).
    None for any other tensor, or where the file system has no O_DIRECT."""
    place = _MAPPED.get(id(tensor))
    if place is None or place.reader is None:
        return None
    return place.reader.fd, place.offset, place.nbytes
