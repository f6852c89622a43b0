"""Running a saved ONNX model in a real ONNX Runtime session, and its static-cache decoder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.errors import ArtifactError, HfExportError
from hfexport.generation import StaticCacheDecoder
from hfexport.targets.manifest import ComponentSpec, InputSpec, Manifest, OutputSpec
from hfexport.targets.onnx.genai import INTERFACE as GENAI
from hfexport.targets.runner import Runner

_ORT_TYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}
_NUMPY_TYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


def _session_spec(session: Any) -> ComponentSpec:
    """What a session alone says about a model saved without a manifest: names, no bounds."""
    inputs = [InputSpec(i.name, i.name) for i in session.get_inputs()]
    return ComponentSpec("", inputs, [OutputSpec(o.name, o.name) for o in session.get_outputs()])


def _load_failure_hint(path: str | Path, installed: str, error: str = "") -> str:
    """What to do about a graph ONNX Runtime cannot load. The decode graphs use ONNX Runtime
    contrib ops (``GroupQueryAttention``'s query lengths, ``MatMulNBits``, …) in forms an older
    ONNX Runtime rejects, so a version other than the one the manifest recorded is named too. A
    kernel the provider lacks (every bfloat16 one on the CPU provider) is not a damaged file."""
    if "NOT_IMPLEMENTED" in error or "Could not find an implementation" in error:
        hint = (
            "the file is whole, but this ONNX Runtime has no kernel for one of its operators in the types it "
            "uses (the CPU provider runs no bfloat16): export with --dtype float32 or float16"
        )
    else:
        hint = "the file may be truncated or not an ONNX model: export again"
    try:
        found = Manifest.find(path)
    except HfExportError:  # a manifest that cannot be read says nothing about the versions
        found = None
    exported_with = found[0].versions.get("onnxruntime") if found else None
    if exported_with and exported_with != installed:
        hint += (
            f"; or it needs the ONNX Runtime it was exported with: onnxruntime {exported_with}, and this is "
            f"{installed} (install onnxruntime=={exported_with}, or export again with this one)"
        )
    return hint


class OnnxRunner(Runner):
    """A real ONNX Runtime session over a saved ``.onnx`` file, fed with the model's keyword
    inputs (tensors, or caches flattened to ``cache.layers.0.keys`` …) matched by name.

    ``spec`` is the component's manifest entry; by default it is read from the ``hfexport.json``
    next to the file. A model saved without one (``onnx_program.save``) runs with its session's
    names and without the exported bounds. ``threads``: ONNX Runtime's intra-op threads (default:
    one per core).
    """

    def __init__(
        self,
        path: str | Path,
        spec: ComponentSpec | None = None,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        threads: int | None = None,
    ) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # errors only: ONNX Runtime warns about every node its constant folding has no CPU kernel for
        options.log_severity_level = 3
        if threads is not None:
            options.intra_op_num_threads = threads
        try:
            self.session = onnxruntime.InferenceSession(str(path), options, providers=list(providers))
        except Exception as error:  # ONNX Runtime raises its own types (InvalidProtobuf, NoSuchFile, …)
            raise ArtifactError(
                f"ONNX Runtime cannot load {path} ({type(error).__name__}: {str(error).strip()[:200]}); "
                f"{_load_failure_hint(path, onnxruntime.__version__, str(error))}"
            ) from error
        if spec is None:
            found = Manifest.find(path)
            spec = found[0].component(found[1]) if found else _session_spec(self.session)
        names = {i.name for i in self.session.get_inputs()}
        expected = {i.name for i in spec.fed}
        if names != expected:
            raise HfExportError(
                f"{path} takes inputs {sorted(names)} but its manifest lists {sorted(expected)}; export again"
            )
        super().__init__(spec)
        self.scalar_outputs = {o.name for o in spec.outputs if o.kind == "scalar"}

    def feed(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``{onnx input name: numpy array}`` from the model's keyword inputs."""
        return {
            spec.name: value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            for spec, value in self.ordered(inputs)
        }

    def session_run(self, feed: dict[str, Any]) -> list[Any]:
        """``session.run`` with ONNX Runtime's failure as an :class:`~hfexport.HfExportError`."""
        try:
            return self.session.run(None, feed)
        except Exception as error:
            if not type(error).__module__.startswith("onnxruntime"):
                raise
            raise self.runtime_failure("ONNX Runtime", _runtime_error_text(error), list(feed.values())) from error

    def run(self, inputs: dict[str, Any], tensors_only: bool = False) -> list[Any]:
        """The outputs in the model's order (``tensors_only``: without symbolic-integer outputs)."""
        outputs = self.session_run(self.feed(inputs))
        names = [o.name for o in self.session.get_outputs()]
        if tensors_only:
            outputs = [o for name, o in zip(names, outputs, strict=True) if name not in self.scalar_outputs]
        return outputs

    def run_named(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The outputs as tensors by keyword path (see :meth:`~hfexport.targets.runner.Runner.by_path`)."""
        outputs = self.session_run(self.feed(inputs))
        order = [o.name for o in self.session.get_outputs()]
        by_name = {o.name: o for o in self.spec.returned}
        if [o.name for o in self.spec.returned] != order and set(order) == set(by_name):
            outputs = [outputs[order.index(o.name)] for o in self.spec.returned]
        return self.by_path([torch.from_numpy(np.asarray(o)) for o in outputs])

    def run_dict(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The outputs by name."""
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session_run(self.feed(inputs)), strict=True))


def _runtime_error_text(error: BaseException) -> str:
    """ONNX Runtime's message without its status prefix and the kernel's source location and check."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    return re.sub(r"/onnxruntime_src/\S+ .*? was false\. ", "", text)


class OnnxDecoder(StaticCacheDecoder):
    """``step`` for :func:`~hfexport.generation.greedy_decode` over an exported static-cache decode
    ``.onnx`` with its manifest, in the spec's interface (the loop's masks and token counters) or
    ONNX Runtime GenAI's (a 2-D mask as wide as the tokens so far: see
    :func:`~hfexport.targets.onnx.genai.genai_io`).

    The cache buffers are allocated from the manifest's written inputs (the sample's shapes, with
    the batch axis resized) and each cache input / write-back output pair is bound to one buffer
    with ONNX Runtime's IO binding, so every step reads and writes the cache in place, with no
    copies between steps.
    """

    def __init__(
        self, path: str | Path, batch_size: int, spec: ComponentSpec | None = None, threads: int | None = None
    ) -> None:
        from hfexport.generation import DecodeMasks

        runner = OnnxRunner(path, spec, threads=threads)
        self.session, self.spec = runner.session, runner.spec
        self.check_batch_size(self.spec, batch_size)
        types = {i.name: i.type for i in self.session.get_inputs()}
        pairs = self.spec.write_backs
        if not pairs:
            raise HfExportError(f"{path} writes no cache in place; export decode with a static cache")
        self.cache: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, str] = {}
        for spec in self.spec.fed:
            if spec.name in pairs:
                shape = [batch_size, *spec.shape[1:]] if spec.shape else []  # scalars (token counters) have no axes
                self.cache[spec.path] = torch.zeros(shape, dtype=_ORT_TYPES[types[spec.name]])
                self.outputs[spec.path] = pairs[spec.name]
        # ONNX Runtime GenAI's interface: a 2-D mask of the tokens so far, from which the graph makes its own
        self.genai = self.spec.interface == GENAI
        masks = [i.shape for i in self.spec.fed if i.path.startswith("attention_mask") and not self.genai]
        self.max_cache_len = self.cache_length(masks, [list(t.shape) for t in self.cache.values()])
        self.logits_name = next(o.name for o in self.spec.outputs if o.kind == "tensor")
        if not self.genai:
            self.masks = DecodeMasks.of_component(self.spec, self.max_cache_len)
        self.position_rows = self.rows_of(next((i.shape for i in self.spec.fed if i.path == "position_ids"), None))
        self.input_name = {spec.path: spec.name for spec in self.spec.fed}
        self.binding = self.session.io_binding()
        for path, buffer in self.cache.items():
            self._bind(self.binding.bind_input, self.input_name[path], buffer)
            self._bind(self.binding.bind_output, self.outputs[path], buffer)
        self.logits_dims, self.logits_dtype = self._logits_shape()

    def _logits_shape(self) -> tuple[list[Any] | None, torch.dtype | None]:
        """The logits' axes as ints or ``(input name, axis)`` of an input axis with the same
        symbol, and their dtype, so each step can bind a tensor of its own for them: collecting
        one output from the binding wraps every output (the cache's too) in Python, about 0.3 ms a
        step. ``(None, None)`` when an axis has no input's symbol: ONNX Runtime allocates then."""
        symbols: dict[str, tuple[str, int]] = {}
        for given in self.session.get_inputs():
            for axis, dim in enumerate(given.shape):
                if isinstance(dim, str):
                    symbols.setdefault(dim, (given.name, axis))
        logits = next(o for o in self.session.get_outputs() if o.name == self.logits_name)
        dims = [dim if isinstance(dim, int) else symbols.get(dim) for dim in logits.shape]
        if None in dims or logits.type not in _ORT_TYPES or _ORT_TYPES[logits.type] not in _NUMPY_TYPES:
            return None, None
        return dims, _ORT_TYPES[logits.type]

    @staticmethod
    def _bind(bind: Any, name: str, tensor: torch.Tensor) -> None:
        bind(name, "cpu", 0, _NUMPY_TYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        feed = {"input_ids": input_ids.contiguous()}
        if "position_ids" in self.input_name:  # a model counting positions from its cache takes none (TrOCR)
            feed["position_ids"] = self.positions(position_ids).contiguous()
        if self.genai:  # a token's slot is its column: the mask is as wide as the last written slot
            feed["attention_mask"] = valid[:, : int(query_slots[-1]) + 1].contiguous()
        else:
            feed.update(self.masks.by_input_path(valid, query_slots))
        feed.update(self.token_types(self.spec.fed, input_ids))
        given = {}
        for path, tensor in feed.items():
            given[self.input_name[path]] = tensor
            self._bind(self.binding.bind_input, self.input_name[path], tensor)
        if self.logits_dims is None:
            self.binding.bind_output(self.logits_name, "cpu")  # allocated by ORT
            self.session.run_with_iobinding(self.binding)
            # outputs come in binding order: the cache pairs first, the logits last
            return torch.from_numpy(self.binding.get_outputs()[-1].numpy().copy())
        shape = [dim if isinstance(dim, int) else self._axis(given, *dim) for dim in self.logits_dims]
        logits = torch.empty(shape, dtype=self.logits_dtype)
        self._bind(self.binding.bind_output, self.logits_name, logits)
        self.session.run_with_iobinding(self.binding)
        return logits

    def _axis(self, given: dict[str, torch.Tensor], name: str, axis: int) -> int:
        tensor = given.get(name)
        if tensor is None:  # a cache buffer
            tensor = self.cache[next(path for path, input_name in self.input_name.items() if input_name == name)]
        return tensor.shape[axis]
