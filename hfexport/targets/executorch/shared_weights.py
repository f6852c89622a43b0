"""Patches that keep ExecuTorch's delegation and serialization from copying the program's weights.

Left alone, a float32 export holds each weight three to four times over before the ``.pte`` is
written (Llama-3.2-1B's shape: 4.6 GiB of weights, a 15.5 GiB peak; 5.3 under these patches): ``to_backend`` deep-copies
each partition's program, the duplication of a constant two partitions share (a tied embedding
table) deep-copies it, and XNNPACK's node visitors and the emitter each take ``bytes`` of every
weight they serialize. Under these patches the copies share the program's tensors, and the bytes
the ``.pte`` is assembled from are read-only views of them (:func:`weights_viewed`), which the
``.pte``'s ``Cord`` writes out as they are. The file is byte for byte the same.

The views read the program's live tensors, which are the model's own (a quantized weight is a new
tensor and is copied as before; a weight the model stores narrower than it computes in is the
program's converted copy, mapping a temporary file whose pages are released once a view of it was
read, and whose key XNNPACK takes from the time it was written:
:mod:`~hfexport.targets.executorch.stored_weights`). Nothing in the lowering writes into one
(XNNPACK's passes and node visitors replace a constant with a new tensor); a weight changed in
place after the export (an optimizer step, ``load_state_dict``) would reach the saved file, so
:class:`WeightCheckedProgram` refuses to write the program then, by the tensors' version counters.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import weakref
from collections.abc import Iterator
from typing import Any

import numpy
import torch

from hfexport.direct_writes import DirectStream
from hfexport.errors import ArtifactError
from hfexport.pipeline.patches import register_patch
from hfexport.targets.executorch.stored_weights import direct_place, known_key, pages_released
from hfexport.versions import require_backend

require_backend("executorch", ("executorch",))
from executorch.exir import ExecutorchProgramManager  # noqa: E402

# The program's tensors by their storage's address while :func:`weights_viewed` is active, and
# the one viewed last (its pages are released when the next is viewed: its reader is done)
_VIEWABLE: dict[int, torch.Tensor] = {}
_last_viewed: list[torch.Tensor] = []


@contextlib.contextmanager
def weights_viewed(program: torch.export.ExportedProgram) -> Iterator[None]:
    """While active, the patched ``bytes`` of a program tensor's whole storage is a read-only
    view of it (which keeps the tensor alive), not a copy."""
    for tensor in (*program.state_dict.values(), *program.constants.values()):
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch._subclasses.FakeTensor):
            _VIEWABLE[tensor.untyped_storage().data_ptr()] = tensor
    try:
        yield
    finally:
        for tensor in _VIEWABLE.values():
            pages_released(tensor)
        _VIEWABLE.clear()
        _last_viewed[:] = []


class _WeightBytes(numpy.ndarray):
    """A weight's storage as bytes, with the tensor it was read from and that tensor's version then."""

    # A memoryview hashes (as the bytes it holds) only when the object it views is hashable, and
    # ExecuTorch's NamedDataStore keys its deduplication on a slice of each blob.
    __hash__ = object.__hash__
    tensor: torch.Tensor
    version: int


def _read_only_view(tensor: torch.Tensor) -> memoryview:
    storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    array = storage.numpy().view(_WeightBytes)
    array.flags.writeable = False
    array.tensor, array.version = tensor, tensor._version
    return memoryview(array)


def changed_weights(program: Any) -> int:
    """How many of the weights ``program``'s ``.pte`` bytes view were changed in place since they were read."""
    return sum(
        1
        for piece in program._pte_data._buffers
        if isinstance(piece, memoryview)
        and isinstance(piece.obj, _WeightBytes)
        and piece.obj.tensor._version != piece.obj.version
    )


class WeightCheckedProgram(ExecutorchProgramManager):
    """An ``ExecutorchProgramManager`` whose ``.pte`` bytes view the model's weights: writing it
    (``save``, ``write_to_file``, ``buffer``) raises :class:`~hfexport.errors.ArtifactError` when
    one of them was changed in place since the export, and ``save`` raises what writing raises."""

    def _check_weights(self) -> None:
        changed = changed_weights(self)
        if changed:
            raise ArtifactError(
                f"{changed} of this ExecuTorch program's weights were changed in place after it was exported, and it "
                "reads them from the model when it is written; save the program before changing the model, or "
                "export again"
            )

    def save(self, path: str) -> None:
        # not the base class's: it logs an error in writing (a full disk) and returns
        if not str(path).endswith(".pte"):
            raise ValueError(f"Path {path} does not end with .pte")
        self._check_weights()  # before a file is opened
        with open(path, "wb") as file:
            self.write_to_file(file)

    def write_to_file(self, open_file: Any) -> None:
        self._check_weights()
        super().write_to_file(_ReleasingWhatItWrites(open_file))

    @property
    def buffer(self) -> bytes:
        if self._buffer is None:
            self._check_weights()
        return super().buffer


class _ReleasingWhatItWrites:
    """A file whose ``write`` of a weight's view then releases the weight's pages
    (:func:`~hfexport.targets.executorch.stored_weights.pages_released`). Into a
    :class:`~hfexport.direct_writes.DirectStream`, a weight that maps the temporary file of
    converted weights is copied from that file past the page cache (read through the mapping,
    its pages would come from the disk one fault at a time)."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def write(self, piece: Any) -> int:
        weight = piece.obj.tensor if isinstance(piece, memoryview) and isinstance(piece.obj, _WeightBytes) else None
        place = direct_place(weight) if weight is not None and isinstance(self.file, DirectStream) else None
        if place is not None and place[2] == piece.nbytes:
            self.file.write_from(*place)
            return piece.nbytes
        written = self.file.write(piece)
        if weight is not None:
            pages_released(weight)
        return written


def _bytes_viewing_weights(original: Any) -> Any:
    def bytes_or_weight_view(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], ctypes.Array):
            tensor = _VIEWABLE.get(ctypes.addressof(args[0]))
            if tensor is not None and tensor.untyped_storage().nbytes() == ctypes.sizeof(args[0]):
                if _last_viewed and _last_viewed[0] is not tensor:
                    pages_released(_last_viewed[0])
                _last_viewed[:] = [tensor]
                return _read_only_view(tensor)
        return original(*args, **kwargs)

    return bytes_or_weight_view


_VIEW_REASON = (
    "{who} serializes a weight as bytes(ctypes array over its storage), a copy of every weight beside the "
    "program's own (Llama-3.2-1B's shape in float32: {size}); under :func:`weights_viewed` the bytes of a "
    "program tensor's storage are a read-only view of it"
)
register_patch(
    "executorch.backends.xnnpack.operators.node_visitor:bytes",
    name="xnnpack_serializes_weight_views",
    reason=_VIEW_REASON.format(who="XNNPACK's node visitor", size="4.6 GB, the delegate's whole weights"),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/operators/node_visitor.py",
    scope="delegate",
)(_bytes_viewing_weights)
register_patch(
    "executorch.exir.emit._emitter:bytes",
    name="emitter_serializes_weight_views",
    reason=_VIEW_REASON.format(who="The emitter", size="1.0 GB, the embedding table the delegate does not take"),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/exir/emit/_emitter.py",
    scope="to_executorch",
)(_bytes_viewing_weights)


class _KnownDigest:
    """A SHA-256 taken earlier, as ``hashlib``'s hash object gives it."""

    def __init__(self, hexdigest: str) -> None:
        self._hex = hexdigest

    def hexdigest(self) -> str:
        return self._hex


# the SHA-256 taken of a weight's bytes, by the weight's id while it lives, with its version then
_DIGESTS: dict[int, tuple[weakref.ref, int, str]] = {}


class _HashlibKnowingWeights:
    """The ``hashlib`` module as XNNPACK's node visitor and the emitter see it under the patches
    below: the "SHA-256" of a converted weight's view (:func:`weights_viewed`) is the key taken as
    it was written (:func:`~hfexport.targets.executorch.stored_weights.known_key`), and another
    weight's, once taken, is taken again only after the weight changed (a tied embedding table is
    XNNPACK's output projection and the emitter's embedding: 1 GB hashed twice at 1B)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(hashlib, name)

    @staticmethod
    def sha256(data: Any = b"", **kwargs: Any) -> Any:
        weight = data.obj.tensor if isinstance(data, memoryview) and isinstance(data.obj, _WeightBytes) else None
        if weight is None or kwargs or data.nbytes != weight.untyped_storage().nbytes():
            return hashlib.sha256(data, **kwargs)
        known = known_key(weight)
        if known is not None:
            return _KnownDigest(known)
        key, taken = id(weight), _DIGESTS.get(id(weight))
        if taken is None or taken[0]() is not weight or taken[1] != weight._version:
            taken = (
                weakref.ref(weight, lambda _: _DIGESTS.pop(key, None)),
                weight._version,
                hashlib.sha256(data).hexdigest(),
            )
            _DIGESTS[key] = taken
        return _KnownDigest(taken[2])


@register_patch(
    "executorch.backends.xnnpack.operators.node_visitor:hashlib",
    name="xnnpack_takes_converted_weights_hashes",
    reason=(
        "XNNPACK's node visitor keys each weight by the SHA-256 of its bytes; a converted weight's key was taken "
        "from the bytes it was converted from as it was written to the temporary file it maps, and hashing it "
        "again reads it back from the disk (Llama-3.2-1B's shape: 2.6 s for 4.6 GB)"
    ),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/operators/node_visitor.py",
    scope="delegate",
)
def _hashlib_knowing_weights(original: Any) -> Any:
    # a hash is reused within one lowering (XNNPACK's, then the emitter's), never from an earlier
    # one: a weight written through .data since keeps its version
    _DIGESTS.clear()
    return _HashlibKnowingWeights()


register_patch(
    "executorch.exir.emit._emitter:hashlib",
    name="emitter_takes_known_weight_hashes",
    reason=(
        "The emitter keys each constant by the SHA-256 of its bytes; a weight XNNPACK's node visitor hashed already "
        "(a tied embedding table, its output projection there: 1 GB at 1B) is not hashed again"
    ),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/exir/emit/_emitter.py",
    scope="to_executorch",
)(lambda original: _HashlibKnowingWeights())


@register_patch(
    "executorch.exir._serialize._cord:Cord.append",
    name="pte_cord_takes_weight_views",
    reason="the .pte's Cord takes only bytes; the weights' read-only views are written as they are",
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/exir/_serialize/_cord.py",
    scope="to_executorch",
)
def _append_taking_views(original: Any) -> Any:
    def append(self: Any, data: Any) -> None:
        if isinstance(data, memoryview) and data.readonly:
            self._buffers.append(data)
            self._byte_size += data.nbytes
        else:
            original(self, data)

    return append


@register_patch(
    "copy:_deepcopy_dispatch",
    name="pte_deepcopy_keeps_weight_views",
    reason=(
        "serialize_pte_binary deep-copies the emitted program, constant buffers included; a read-only view, "
        "like bytes, is its own copy (a memoryview has no deep copy)"
    ),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/exir/_serialize/_program.py",
    scope="to_executorch",
)
def _dispatch_keeping_views(original: dict) -> dict:
    def keep_read_only(view: memoryview, memo: dict) -> memoryview:
        if not view.readonly:
            raise TypeError("cannot pickle 'memoryview' object")
        return view

    return {**original, memoryview: keep_read_only}


class _CopySharingWeights:
    """The ``copy`` module as ExecuTorch's delegation sees it under the patches below: a deep copy
    of an exported program shares its weight and constant tensors (the memo is seeded with them),
    a deep copy of a tensor is the tensor, and the rest is copied."""

    def __getattr__(self, name: str) -> Any:
        return getattr(copy, name)

    @staticmethod
    def deepcopy(value: Any, memo: dict[int, Any] | None = None) -> Any:
        if isinstance(value, torch.Tensor):
            return value
        memo = {} if memo is None else memo
        if isinstance(value, torch.export.ExportedProgram):
            for tensor in (*value.state_dict.values(), *value.constants.values()):
                memo[id(tensor)] = tensor
        return copy.deepcopy(value, memo)


@register_patch(
    "executorch.exir.backend.backend_api:copy",
    name="delegate_copies_share_weights",
    reason=(
        "to_backend deep-copies every partition's program before the backend's preprocess ('in case backends "
        "change graph inside preprocess'), weights included (SmolLM2-135M fp32: 1.29 -> 2.42 GB, Llama-3.2-1B's "
        "shape 5.3 -> 15.5 GB, with XNNPACK's bytes). The copies share the weight tensors instead: XNNPACK's "
        "passes and node visitors replace a constant with a new tensor, none writes into one"
    ),
    upstream="https://github.com/pytorch/executorch/pull/4311",  # retiring the deep copy, not merged
    scope="delegate",
)
def _copy_sharing_weights(original: Any) -> Any:
    return _CopySharingWeights()


register_patch(
    "executorch.exir.backend.canonical_partitioners.duplicate_constant_node_pass:copy",
    name="duplicated_constants_share_weights",
    reason=(
        "a constant that a delegated and a portable node both read (a tied embedding table: the lm_head's "
        "weight and the embedding's) is duplicated with a deep copy of its tensor (Llama-3.2-1B's shape: 1.0 GB); "
        "the two placeholders share the one tensor instead, which neither writes into"
    ),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/exir/backend/canonical_partitioners/duplicate_constant_node_pass.py",
    scope="delegate",
)(_copy_sharing_weights)
