"""Load and run exported artifacts on their runtimes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.errors import HfExportError


def load_exported_program(path: str | Path) -> torch.export.ExportedProgram:
    """``torch.export.load`` after registering what a transformers program's inputs and outputs
    are made of (``ModelOutput`` classes and the cache classes), so it works in a fresh process."""
    import transformers.modeling_outputs  # noqa: F401  (registers the ModelOutput pytree nodes)

    from hfexport.pipeline.pytree import register_cache_pytrees

    register_cache_pytrees()
    return torch.export.load(path)


class OnnxRunner:
    """A real ONNX Runtime session over a saved ``.onnx`` file, fed with the model's keyword
    inputs (tensors, or caches flattened to ``cache.layers.0.keys`` …).

    Inputs are checked against the model before running: a missing input, a wrong rank, or an
    axis outside the bounds recorded at capture raises :class:`~hfexport.HfExportError` naming
    the input, the axis and the bound.
    """

    def __init__(self, path: str | Path, providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> None:
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(path), providers=list(providers))
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.scalar_outputs = set(filter(None, metadata.get("hfexport.scalar_outputs", "").split(",")))
        self.bounds = {
            (axis["input"], axis["axis"]): axis for axis in json.loads(metadata.get("hfexport.input_axes", "[]"))
        }
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def feed(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``{onnx input name: numpy array}`` from the model's keyword inputs."""
        import torch.utils._pytree as pytree

        from hfexport.pipeline.capture import normalize_inputs
        from hfexport.pipeline.io_names import path_name
        from hfexport.pipeline.pytree import register_cache_pytrees

        register_cache_pytrees()
        flat = {
            path_name(path): leaf
            for path, leaf in pytree.tree_flatten_with_path(normalize_inputs(inputs, renames=True))[0]
        }
        missing = [name for name in self.input_names if name not in flat]
        if missing:
            raise HfExportError(
                f"the ONNX model needs input(s) {missing}; got {sorted(flat)}. Pass the same keyword inputs "
                "(and cache structure) as the export sample."
            )
        feed = {}
        for spec in self.session.get_inputs():
            value = flat[spec.name]
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            self._check(spec, array)
            feed[spec.name] = array
        return feed

    def _check(self, spec: Any, array: Any) -> None:
        if len(spec.shape) != array.ndim:
            raise HfExportError(
                f"input {spec.name!r} has rank {array.ndim}, the model expects {len(spec.shape)} ({spec.shape})"
            )
        for axis, (expected, size) in enumerate(zip(spec.shape, array.shape, strict=True)):
            if isinstance(expected, int) and expected != size:
                raise HfExportError(
                    f"input {spec.name!r} axis {axis} has size {size}, but the model was exported with a static "
                    f"size {expected} on this axis; export with dynamic=True or dynamic_shapes covering it"
                )
            bound = self.bounds.get((spec.name, axis))
            if bound and bound["dynamic"] and bound["max"] is not None and size > bound["max"]:
                raise HfExportError(
                    f"input {spec.name!r} axis {axis} has size {size}, above the exported upper bound {bound['max']}"
                )

    def run(self, inputs: dict[str, Any], tensors_only: bool = False) -> list[Any]:
        """The outputs in the model's order (``tensors_only``: without symbolic-integer outputs)."""
        outputs = self.session.run(None, self.feed(inputs))
        if tensors_only:
            outputs = [o for name, o in zip(self.output_names, outputs, strict=True) if name not in self.scalar_outputs]
        return outputs

    def run_dict(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The outputs by name."""
        return dict(zip(self.output_names, self.session.run(None, self.feed(inputs)), strict=True))


class ExecutorchRunner:
    """The ExecuTorch Python runtime over a ``.pte`` file (or its bytes), fed with the model's
    keyword inputs in order (caches flattened).

    Each input is checked against the program's planned (upper-bound) sizes before running, so an
    out-of-range shape raises :class:`~hfexport.HfExportError` naming the input, the axis and the
    bound instead of the runtime's bare error code. Input names come from the ``<file>.json``
    that hfexport writes next to a saved ``.pte``.
    """

    def __init__(self, source: str | Path | bytes) -> None:
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(source if isinstance(source, bytes) else str(source))
        self.method = self.program.load_method("forward")
        meta = self.method.metadata
        self.upper_bounds = [tuple(meta.input_tensor_meta(i).sizes()) for i in range(meta.num_inputs())]
        sidecar = None if isinstance(source, bytes) else Path(f"{source}.json")
        names = json.loads(sidecar.read_text())["inputs"] if sidecar and sidecar.is_file() else []
        self.input_names = (
            names if len(names) == len(self.upper_bounds) else [f"input {i}" for i in range(len(self.upper_bounds))]
        )

    def flat_inputs(self, inputs: dict[str, Any]) -> list[torch.Tensor]:
        import torch.utils._pytree as pytree

        from hfexport.pipeline.capture import normalize_inputs
        from hfexport.pipeline.pytree import register_cache_pytrees

        register_cache_pytrees()
        leaves = pytree.tree_leaves(normalize_inputs(inputs, renames=True))
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def check(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.upper_bounds):
            raise HfExportError(
                f"the program takes {len(self.upper_bounds)} input tensors ({', '.join(self.input_names)}), "
                f"got {len(tensors)}"
            )
        for name, tensor, bounds in zip(self.input_names, tensors, self.upper_bounds, strict=True):
            if tensor.dim() != len(bounds):
                raise HfExportError(f"input {name!r} has rank {tensor.dim()}, the program expects {len(bounds)}")
            for axis, (size, bound) in enumerate(zip(tensor.shape, bounds, strict=True)):
                if size > bound:
                    raise HfExportError(
                        f"input {name!r} axis {axis} has size {size}, above the program's upper bound {bound} "
                        "(ExecuTorch plans memory for the bounds fixed at export: raise max_seq_len / "
                        "max_batch_size or the Dim max and export again)"
                    )

    def run(self, inputs: dict[str, Any]) -> list[Any]:
        """The program's outputs, in order."""
        tensors = self.flat_inputs(inputs)
        self.check(tensors)
        return list(self.method.execute(tensors))
