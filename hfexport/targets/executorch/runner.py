"""Running a saved ExecuTorch program on the ExecuTorch Python runtime, and its static-cache decoder."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hfexport.errors import ArtifactError, HfExportError
from hfexport.generation import StaticCacheDecoder
from hfexport.targets.executorch.llm_runner import POSITIONS
from hfexport.targets.executorch.manifest_entry import pte_component
from hfexport.targets.manifest import ComponentSpec, Manifest
from hfexport.targets.runner import Runner

# executorch/runtime/core/error.h: what the runtime's bare codes mean
_RUNTIME_ERRORS = {
    0x01: "an internal error",
    0x02: "an invalid state",
    0x10: "an operation it does not support",
    0x11: "an operation not implemented",
    0x12: "an invalid argument",
    0x13: "an invalid type",
    0x14: "a missing operator (a kernel this runtime build lacks)",
    0x20: "something not found",
    0x21: "a failed memory allocation",
    0x22: "a failed file access",
    0x23: "an invalid program",
    0x24: "invalid external data",
    0x25: "running out of resources",
    0x30: "a delegate incompatible with this runtime",
    0x31: "a failed delegate memory allocation",
    0x32: "an invalid delegate handle",
}


def runtime_error_text(error: BaseException) -> str:
    """The runtime's message with its hexadecimal error code named (``0x12``: an invalid argument)."""
    text = str(error).strip()[:200]
    found = re.search(r"0x:?\s*([0-9a-fA-F]+)", text)
    meaning = _RUNTIME_ERRORS.get(int(found.group(1), 16)) if found else None
    return f"{text}: {meaning}" if meaning else text


def _register_llm_kernels() -> None:
    """Register ExecuTorch's LLM kernels (``llama::custom_sdpa``, which ``attention_as_custom_sdpa``
    uses) with this runtime: its Python build has them only once that library is loaded. A build
    without the library loads every program that does not use them."""
    try:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    except ImportError:
        pass


class ExecutorchRunner(Runner):
    """The ExecuTorch Python runtime over a ``.pte`` file, its bytes, or an in-memory
    ``ExecutorchProgramManager``, fed with the model's keyword inputs matched by name.

    The method takes its inputs by position; their names and order come from ``spec`` (for a file,
    the ``hfexport.json`` next to it; for a program manager, the program itself). Each input is
    checked against the exported ranges and the program's planned (upper-bound) sizes before
    running, so a bad input raises :class:`~hfexport.HfExportError` naming the input and the axis
    instead of the runtime's bare error code.
    """

    def __init__(self, source: str | Path | bytes | Any, spec: ComponentSpec | None = None) -> None:
        from executorch.runtime import Runtime

        _register_llm_kernels()

        if spec is None:
            spec = _spec_of(source)
        data = source.buffer if hasattr(source, "buffer") else source
        try:
            self.program = Runtime.get().load_program(data if isinstance(data, bytes) else str(data))
            self.method = self.program.load_method("forward")
        except (RuntimeError, ValueError) as error:  # the runtime's bare codes ("error: 0x23")
            where = "the program" if isinstance(data, bytes) else str(data)
            text = runtime_error_text(error)
            cause = (
                "the runtime's log above names the operator; export with this executorch version, or load "
                "the library that registers it first"
                if "missing operator" in text
                else "the file may be truncated or not a .pte program: export again"
            )
            raise ArtifactError(f"the ExecuTorch runtime cannot load {where} ({text}); {cause}") from error
        meta = self.method.metadata
        slots = [i for i in spec.inputs if i.constant is None and not i.state]  # the method's inputs
        if len(slots) != meta.num_inputs():
            raise HfExportError(
                f"the program takes {meta.num_inputs()} inputs but its manifest lists {len(slots)} "
                f"({', '.join(i.name for i in slots)}); export again"
            )
        self.none_slots = [index for index, i in enumerate(slots) if i.none]  # fed None
        fed_slots = [index for index, i in enumerate(slots) if not i.none]
        self.upper_bounds = [tuple(meta.input_tensor_meta(i).sizes()) for i in fed_slots]
        self.fed = spec.fed  # the manifest's inputs in the method's order (checked on every step)
        super().__init__(spec)

    def check_planned(self, values: list[Any], indices: Sequence[int] | None = None) -> None:
        """Raise :class:`HfExportError` if an input (of ``values``, or only those at ``indices``)
        exceeds the size the program planned for it."""
        if len(values) != len(self.fed):
            raise HfExportError(f"the program takes {len(self.fed)} inputs, got {len(values)}")
        for index in range(len(values)) if indices is None else indices:
            spec, value, bounds = self.fed[index], values[index], self.upper_bounds[index]
            shape = tuple(getattr(value, "shape", ()))
            if len(shape) != len(bounds):
                raise HfExportError(f"input {spec.name!r} has rank {len(shape)}, the program expects {len(bounds)}")
            for axis, (size, bound) in enumerate(zip(shape, bounds, strict=True)):
                if size > bound:
                    raise HfExportError(
                        f"input {spec.name!r} axis {axis} has size {size}, above the exported upper bound {bound} "
                        "(ExecuTorch plans memory for the bounds fixed at export: raise max_seq_len / "
                        "max_batch_size or the Dim max and export again)"
                    )

    def run(self, inputs: dict[str, Any], state_given: bool = False) -> list[Any]:
        """The program's outputs, in order (write-backs of updated inputs included); see
        :meth:`~hfexport.targets.runner.Runner.ordered` for ``state_given``."""
        return list(self.execute(self.tensors(inputs, state_given)))

    def run_named(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The outputs by keyword path (see :meth:`~hfexport.targets.runner.Runner.by_path`); what
        the program keeps as its state stays inside and is neither fed nor returned."""
        return self.by_path(self.run(inputs, state_given=True))

    def tensors(self, inputs: dict[str, Any], state_given: bool = False) -> list[Any]:
        """The method's inputs, in its order, from the model's keyword inputs (checked; the runtime
        takes contiguous tensors only)."""
        values = [
            value.contiguous() if isinstance(value, torch.Tensor) else value
            for _, value in self.ordered(inputs, state_given)
        ]
        self.check_planned(values)
        return values

    def execute(self, values: list[Any], clone_outputs: bool = True) -> Any:
        """``method.execute`` with the runtime's failure as an :class:`~hfexport.HfExportError`.
        ``clone_outputs=False`` returns tensors over the program's planned memory, valid until the
        next call (``executorch.runtime.Method.execute`` always clones, with torch: its pybindings
        method takes the flag); with ``clone_outputs`` the tensors are copied out as
        :func:`_copied` does."""
        slots = list(values)
        for index in self.none_slots:
            slots.insert(index, None)
        try:
            outputs = self.method._method(slots, clone_outputs=False)
            if not clone_outputs:
                return outputs
            return [_copied(value) if isinstance(value, torch.Tensor) else value for value in outputs]
        except RuntimeError as error:
            raise self.runtime_failure("the ExecuTorch runtime", runtime_error_text(error), values) from error


def _spec_of(source: Any) -> ComponentSpec:
    if hasattr(source, "exported_program"):
        return pte_component(source)
    found = None if isinstance(source, bytes) else Manifest.find(source)
    if found is None:
        raise HfExportError(
            "an ExecuTorch program takes its inputs by position, and without hfexport's manifest "
            "(hfexport.json next to the .pte) their names are unknown; save the export with hfexport "
            "(`hfexport export ... --out DIR` or hfexport.save_export) or pass the ExecutorchProgramManager"
        )
    manifest, component = found
    return manifest.component(component)


class ExecutorchDecoder(StaticCacheDecoder):
    """``step`` for :func:`~hfexport.generation.greedy_decode` over an exported static-cache decode
    ``.pte`` with its manifest (which names the inputs and the write-back of each cache input).

    By default the program keeps the cache's keys and values as its state (see
    :func:`~hfexport.targets.executorch.lowering.cache_as_program_state`) and only the token
    counters go in and come back. A program that takes the whole cache as inputs
    (``cache_in_program=False``) gets it fed every step: the Python runtime copies inputs into the
    method's planned buffers and does not expose binding outputs onto inputs
    (``Method::set_output_data_ptr`` is C++ only), so each step reads the updated cache back from
    the write-back outputs. Outputs come uncloned, over the program's memory, and only the logits
    and write-backs are copied out.
    """

    def __init__(self, source: str | Path | Any, batch_size: int, spec: ComponentSpec | None = None) -> None:
        from hfexport.generation import DecodeMasks

        self.runner = ExecutorchRunner(source, spec)
        self.spec = self.runner.spec
        self.check_batch_size(self.spec, batch_size)
        pairs = self.spec.write_backs
        if not pairs and not any(i.state for i in self.spec.inputs):
            raise HfExportError("the decode program writes no cache in place; export decode with a static cache")
        self.cache: dict[str, torch.Tensor] = {}
        for spec, bounds in zip(self.spec.fed, self.runner.upper_bounds, strict=True):
            if spec.name in pairs:
                shape = list(spec.shape or bounds)
                shape = [batch_size, *shape[1:]] if shape else []
                self.cache[spec.path] = torch.zeros(shape, dtype=getattr(torch, spec.dtype or "float32"))
        # the keys and values the program keeps as its state are not fed: the loop resets only the
        # token counters, and slots left from an earlier sequence are masked until written again
        held = [i.shape for i in self.spec.inputs if i.state] + [list(t.shape) for t in self.cache.values()]
        masks = [i.shape for i in self.spec.fed if i.path.startswith("attention_mask")]
        self.max_cache_len = self.cache_length(masks, held)
        outputs = self.spec.returned
        self.written_at = {o.writes: i for i, o in enumerate(outputs) if o.kind == "write_back"}
        self.logits_index = next(i for i, o in enumerate(outputs) if o.kind == "tensor")
        # the inputs this loop feeds from outside (not the cache it keeps): the ones checked each step
        self.outside = [index for index, spec in enumerate(self.runner.fed) if spec.path not in self.cache]
        self.position_rows = self.rows_of(next((i.shape for i in self.spec.fed if i.path == "position_ids"), None))
        # ExecuTorch's LLM runner's interface: the new tokens' cache slots, from which the program makes the rest
        self.slots_only = any(i.path == POSITIONS for i in self.spec.fed)
        self.masks = DecodeMasks.of_component(self.spec, self.max_cache_len)

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.slots_only:  # one row, filled without gaps: the slots are its positions
            fed = {"input_ids": input_ids, POSITIONS: torch.as_tensor(query_slots, dtype=torch.long)}
        else:
            fed = {"input_ids": input_ids, "position_ids": self.positions(position_ids)}
            fed.update(self.masks.by_input_path(valid, query_slots))
        fed.update(self.token_types(self.runner.fed, input_ids))
        values = []
        for spec in self.runner.fed:
            if spec.path in self.cache:
                values.append(self.cache[spec.path])
            elif spec.path in fed:
                values.append(fed[spec.path])
            else:
                raise HfExportError(
                    f"the decode program takes an input {spec.name!r} this decode loop does not provide"
                )
        self.runner.check_planned(values, self.outside)
        # only what is kept is copied out of the program's memory: not the cache it also returns
        outputs = self.runner.execute(values, clone_outputs=False)
        for path, index in self.written_at.items():
            self.cache[path] = _copied(outputs[index])
        return _copied(outputs[self.logits_index])


def _copied(tensor: torch.Tensor) -> torch.Tensor:
    """A copy made by numpy on this thread. torch copies a tensor as large as the logits on its
    OpenMP pool, whose idle workers then spin for a while and take the cores XNNPACK's threads
    need for the next step: with torch's default threads, SmolLM2's 8da4w step took 6.4–7.9 ms
    instead of 4.5–5.0 on this 2-core machine. A dtype numpy lacks (bfloat16) takes torch's copy."""
    if tensor.dim() == 0:  # a token counter: torch's copy of one element is the cheaper
        return tensor.clone()
    try:
        return torch.from_numpy(tensor.numpy().copy())
    except TypeError:
        return tensor.clone()
