"""Export precision: the ``dtype`` of a config, resolved against the model's own and against what
each target's runtime runs, and the converted copy of the model an export then captures.

``dtype="auto"`` keeps the model's dtype where the target runs it and otherwise converts to
float32, saying so in one warning per target (a bfloat16 checkpoint for ONNX Runtime's CPU
provider, which has no bfloat16 kernels, or for ExecuTorch's XNNPACK delegate, which takes none).
An explicit dtype converts to it; a dtype the target's runtime cannot run is refused when the
config is made. The user's model and inputs are never changed: a conversion makes a copy of the
model whose floating-point weights are converted directly from the originals
(:func:`converted_model`), so the export holds the model twice only when it must, and never a
third copy in the old dtype.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hfexport.computed_weights import ComputedIn
from hfexport.direct_writes import BLOCK, aligned_empty, direct_stream

logger = logging.getLogger("hfexport")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The floating-point dtype most of ``model``'s parameter and buffer elements are computed in
    (None without floating-point weights)."""
    counts: dict[torch.dtype, int] = {}
    computed = _stored(model)
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            dtype = computed.get(id(tensor), tensor.dtype)
            counts[dtype] = counts.get(dtype, 0) + tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def check_dtype(config: Any) -> None:
    """Raise :class:`~hfexport.ConfigError` for a ``dtype`` that is not a choice, or that the
    config's target cannot run (one line naming the field and what to pass instead)."""
    from hfexport.errors import ConfigError

    dtype = config.dtype
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(
            f"{type(config).__name__} dtype must be one of {', '.join(map(repr, DTYPE_CHOICES))}, got {dtype!r}"
        )
    target = _target(config)
    if dtype == "auto" or target is None or dtype in target.dtypes:
        return
    others = " or ".join(repr(name) for name in target.dtypes)
    raise ConfigError(
        f"{type(config).__name__} dtype {dtype!r}: {target.runtime} has no {dtype} kernels, so the program could "
        f"not run; use dtype {others} ('auto' exports a {dtype} model in float32)"
    )


def _target(config: Any) -> Any:
    from hfexport.targets import TARGETS, get_target

    name = getattr(config, "export_format", None)
    return get_target(name) if name in TARGETS else None


def resolve_dtype(model: torch.nn.Module, config: Any) -> torch.dtype | None:
    """The dtype ``config`` exports ``model`` in: its explicit ``dtype``, else (``"auto"``) the
    model's own where the target runs it, else float32. None for a model without floating-point
    weights (nothing to convert)."""
    own = model_dtype(model)
    if own is None:
        return None
    name = getattr(config, "dtype", "auto")
    if name != "auto":
        return DTYPES[name]
    target = _target(config)
    if target is None or dtype_name(own) not in DTYPES or target.why_auto_converts(config, dtype_name(own)) is None:
        return own
    return torch.float32


def converted_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` whose floating-point parameters and buffers are ``dtype`` (what
    ``copy.deepcopy(model).to(dtype)`` gives, tied weights still tied). Each converted tensor is
    made from the original directly: the copy never holds the weights in their old dtype, so the
    peak is the model plus its converted weights. ``model`` is not changed. The copy's weights are
    hfexport's alone (:func:`~hfexport.pipeline.pass_manager.private_weights`): the programs made
    from it share them."""
    from hfexport.pipeline.pass_manager import private_weights

    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo or not tensor.is_floating_point() or tensor.dtype == dtype:
            continue
        with torch.no_grad():
            value = tensor.detach().to(dtype)
        if isinstance(tensor, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = value
    copied = private_weights(copy.deepcopy(model, memo))
    config = getattr(copied, "config", None)
    if config is not None and hasattr(config, "dtype"):
        # what from_pretrained(dtype=...) records; some models read it to make their caches
        config.dtype = dtype
    return copied


def converted_inputs(inputs: Any, old: torch.dtype, new: torch.dtype) -> Any:
    """``inputs`` with each ``old``-dtype floating tensor (pixel values, audio features) as ``new``
    (new tensors; the others are kept as they are)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(new) if inputs.dtype == old else inputs
    if isinstance(inputs, dict):
        return {key: converted_inputs(value, old, new) for key, value in inputs.items()}
    if isinstance(inputs, (list, tuple)) and not hasattr(inputs, "_fields"):
        return type(inputs)(converted_inputs(value, old, new) for value in inputs)
    return inputs


def group_by_dtype(model: torch.nn.Module, configs: Sequence[Any]) -> dict[torch.dtype | None, list[int]]:
    """The indices of ``configs`` (each a config, or ``{component: config}``) by the dtype each
    exports ``model`` in, in order; configs of one dtype can share one capture."""
    groups: dict[torch.dtype | None, list[int]] = {}
    for index, config in enumerate(configs):
        found = {resolve_dtype(model, c) for c in (config.values() if isinstance(config, dict) else [config])}
        if len(found) > 1:
            from hfexport.errors import ConfigError

            raise ConfigError(
                "the per-component configs of one target export the model in different dtypes "
                f"({', '.join(sorted(dtype_name(d) for d in found if d is not None))}); give them one dtype"
            )
        groups.setdefault(found.pop(), []).append(index)
    return groups


def in_dtype(
    model: torch.nn.Module, inputs: Any, dtype: torch.dtype | None, configs: Sequence[Any], in_place: bool = False
) -> tuple[torch.nn.Module, Any]:
    """``(model, inputs)`` in ``dtype``: the same objects when the model already is, else a
    converted copy (:func:`converted_model`; ``in_place``: the model itself, which the caller
    owns, :func:`converted_in_place`), announced in one warning per target whose ``auto``
    converts because its runtime cannot run the model's dtype (or not fast), else at INFO level."""
    own = model_dtype(model)
    if dtype is None or own is None or own == dtype:
        return model, inputs
    flat = [c for config in configs for c in (config.values() if isinstance(config, dict) else [config])]
    automatic = {c.export_format: c for c in flat if getattr(c, "dtype", "auto") == "auto"}
    for export_format, config in sorted(automatic.items()):
        target = _target(config)
        why = target.why_auto_converts(config, dtype_name(own)) if target is not None else None
        halves = [
            name for name in (target.dtypes if target is not None else ()) if name not in ("float32", dtype_name(own))
        ]
        other = f"; dtype={halves[0]!r} gives a half-precision program" if halves else ""
        logger.warning(
            "%s: exporting the %s model in %s for %s%s",
            why or f"{export_format} runs no {dtype_name(own)}",
            dtype_name(own),
            dtype_name(dtype),
            export_format,
            other,
        )
    if not automatic:
        logger.info("converting the %s model to %s (dtype=%r)", dtype_name(own), dtype_name(dtype), dtype_name(dtype))
    if in_place:
        targets = [(_target(config), config) for config in flat]

        def keep_stored(module: torch.nn.Module) -> bool:
            return bool(targets) and all(t is not None and t.keeps_stored(c, module) for t, c in targets)

        converted = converted_in_place(model, dtype, keep_stored=keep_stored)
    else:
        converted = converted_model(model, dtype)
    return converted, converted_inputs(inputs, own, dtype)


def _widens_exactly(old: torch.dtype, new: torch.dtype) -> bool:
    return new == torch.float32 and old in (torch.bfloat16, torch.float16)


def converted_in_place(
    model: torch.nn.Module, dtype: torch.dtype, keep_stored: bool | Callable[[torch.nn.Module], bool] = False
) -> torch.nn.Module:
    """``model`` computing in ``dtype``, changed in place (a model the caller owns: the command
    line's).

    With ``keep_stored`` (true, or true of the module: every target it is exported for converts
    the module's stored weights as it writes them, :meth:`~hfexport.targets.Target.keeps_stored`),
    a weight that ``dtype`` holds exactly (a bfloat16 or float16 checkpoint in float32), but for
    embedding tables and the first parameter, stays as it was read, memory-mapped, and is computed
    in ``dtype`` (:class:`ComputedIn`): the program casts it, and the target converts each weight
    on its own as it writes it, as ONNX Runtime GenAI's builder converts a layer at a time. Holding
    the float32 weights from the capture to the save, a Llama-3.2-1B-shaped checkpoint's ONNX
    export peaked at 5.3 GiB; it now peaks at 3.5 GiB (the builder: 5.0).

    Any other tensor is converted one at a time, the old one's memory going as the new one is
    made; for weights read from a memory-mapped checkpoint, the pages read are paged out too (the
    kernel counts a mapped file's pages in the process's memory until the whole file is unmapped:
    converting Llama-3.2-1B's bfloat16 checkpoint to float32 peaked at 7.3 GB instead of 5.0)."""
    from torch.nn.utils import parametrize

    with torch.no_grad():
        # converted: an embedding table (cast whole at every eager forward, twice when tied to the
        # output projection, to read a few rows: half of the casts' time), and the first
        # floating-point parameter, whose dtype transformers' ``PreTrainedModel.dtype`` reports
        # (models cast their inputs and masks to it)
        first = [t for t in model.parameters() if t.is_floating_point()][:1]
        converted = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} | set(map(id, first))
        for module in list(model.modules()):
            keeps = keep_stored(module) if callable(keep_stored) else keep_stored
            for name, tensor in list(module.named_parameters(recurse=False)):
                if keeps and id(tensor) not in converted and _widens_exactly(tensor.dtype, dtype):
                    parametrize.register_parametrization(module, name, ComputedIn(dtype), unsafe=True)
        stored = _stored(model)
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and tensor.dtype != dtype and id(tensor) not in stored:
                old = tensor.data
                tensor.data = old.to(dtype)
                _page_out(old)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "dtype"):
        config.dtype = dtype
    return model


def _stored(model: torch.nn.Module) -> dict[int, torch.dtype]:
    """``{id(stored weight): the dtype it is computed in}`` for ``model``'s :class:`ComputedIn` weights."""
    stored: dict[int, torch.dtype] = {}
    for module in model.modules():
        for parametrizations in getattr(module, "parametrizations", {}).values():
            if len(parametrizations) == 1 and isinstance(parametrizations[0], ComputedIn):
                stored[id(parametrizations.original)] = parametrizations[0].dtype
    return stored


def _page_out(tensor: torch.Tensor) -> None:
    """Ask the kernel to reclaim the pages of ``tensor``'s storage (``MADV_PAGEOUT``, Linux 5.4+):
    clean pages of a mapped file go (read again if touched again); anything else is kept, so the
    values never change. Elsewhere, and on any error, nothing happens."""
    import ctypes
    import mmap
    import sys

    if not sys.platform.startswith("linux"):
        return
    storage = tensor.untyped_storage()
    page = mmap.PAGESIZE
    start = -(-storage.data_ptr() // page) * page
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)  # MADV_PAGEOUT
    except (OSError, AttributeError):
        pass


# the rows converted and written at a time
_SLICE_BYTES = 64 << 20
_reused = threading.local()


@contextlib.contextmanager
def buffers_reused() -> Iterator[None]:
    """Within it, every :func:`write_converted` of this thread copies its slices into the same
    buffers. Fresh ones fault every page in again for each weight: writing Llama-3.2-1B's
    matrices converted to float32 took 4.6 to 5.1 s of kernel time with them, 3.4 s reused."""
    _reused.buffers = {}
    try:
        yield
    finally:
        del _reused.buffers


def _buffer(slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    buffers = getattr(_reused, "buffers", None)
    nbytes = math.prod(shape) * dtype.itemsize
    if buffers is None:
        return aligned_empty(nbytes).view(dtype).view(shape)
    if slot not in buffers or buffers[slot].numel() < nbytes:
        buffers[slot] = aligned_empty(nbytes)
    return buffers[slot][:nbytes].view(dtype).view(shape)


def write_converted(source: torch.Tensor, dtype: torch.dtype, file: Any, digest: Any = None) -> None:
    """Write ``source`` (a tensor of any strides and floating-point dtype) to ``file`` as a
    row-major tensor of ``dtype``, converted a slice of rows at a time: a save never holds a
    second whole copy of a weight (Llama-3.2-1B's 128,256 × 2,048 output projection alone is
    1 GB in float32). A slice is converted into a page-aligned buffer and written from it past the
    page cache where the file allows (:mod:`~hfexport.direct_writes`). ``digest`` (a ``hashlib``
    hash), when given, is updated with ``source``'s own bytes, row-major: in a narrower dtype, half
    as many as are written."""
    source = source.detach()
    rows = source.reshape(1) if source.dim() == 0 else source
    row_bytes = max(1, rows[0].numel() * dtype.itemsize)
    step = max(1, _SLICE_BYTES // row_bytes)
    stage = _buffer("stage", (_SLICE_BYTES + 2 * BLOCK,), torch.uint8)
    stream = direct_stream(file, stage, rows.numel() * dtype.itemsize)
    # converted straight into the stream's staging buffer, unless the stream's position is not a
    # multiple of the dtype's size (then converted beside it and copied in)
    in_stage = stream is not None and stream.fits(step * row_bytes, dtype)
    buffer = None if in_stage else _buffer("rows", (min(step, len(rows)), *rows.shape[1:]), dtype)
    # a transposed matrix: its rows are the columns of a row-major one, converted a block of
    # columns at a time and transposed in the new dtype (converting and transposing in one
    # copy runs torch's slow strided path: 3 times the CPU time)
    columns = rows.t() if rows.dim() == 2 and rows.stride(0) == 1 and rows.stride(1) != 1 else None
    converted = _buffer("columns", (len(columns), step), dtype) if columns is not None else None
    with stream or contextlib.nullcontext():
        for start in range(0, len(rows), step):
            count = min(step, len(rows) - start)
            part = stream.tensor((count, *rows.shape[1:]), dtype) if in_stage else buffer[:count]
            if columns is None:
                part.copy_(rows[start : start + count])
            else:
                block = converted[:, :count]
                block.copy_(columns[:, start : start + count])
                part.copy_(block.t())
            if digest is not None:
                taken = rows[start : start + count].contiguous()
                digest.update(memoryview(taken.reshape(-1).view(torch.uint8).numpy()))
            data = memoryview(part.reshape(-1).view(torch.uint8).numpy())
            if in_stage:
                stream.advance(len(data))
            else:
                (stream or file).write(data)
