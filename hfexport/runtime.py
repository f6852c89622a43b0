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
        # a cache the program writes in place is fed as input.<name>
        flat.update({f"input.{name}": value for name, value in list(flat.items())})
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
        self.sidecar = json.loads(sidecar.read_text()) if sidecar and sidecar.is_file() else {}
        names = self.sidecar.get("inputs", [])
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


# --- greedy decoding over an exported static-cache decode graph ------------------------------


def decode_mask(valid: torch.Tensor, query_slots: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The 4-D boolean mask ``[batch, 1, queries, cache_len]`` of a static-cache decode step:
    query at cache slot ``s`` sees slot ``j`` when ``j <= s`` and ``valid[b, j]`` (written and not
    padding), and, for a sliding-window layer type, ``s - j < window``."""
    cache_len = valid.shape[-1]
    slots = torch.arange(cache_len)[None, :]
    visible = slots <= query_slots[:, None]
    if window is not None:
        visible &= slots > query_slots[:, None] - window
    return (visible[None] & valid[:, None, :].bool())[:, None]


class DecodeMasks:
    """Builds a decode graph's attention masks in the structure it was exported with: one 4-D
    ``attention_mask`` (``layer_types`` None), or one per layer type (``attention_mask.<type>``
    inputs), each layer type in ``windows`` limited to its sliding window. Raises
    :class:`~hfexport.HfExportError` up front for a layer type it cannot build."""

    def __init__(self, layer_types: list[str] | None, windows: dict[str, int]) -> None:
        unsupported = sorted(set(layer_types or ()) - {"full_attention"} - set(windows))
        if unsupported:
            raise HfExportError(
                f"the decode graph takes attention masks for layer types {unsupported}; the decode loops "
                "build full-attention masks and the sliding-window masks of windowed static layers only "
                "(export with hfexport's export_for_generation and a static cache)"
            )
        self.layer_types = layer_types
        self.windows = windows

    @classmethod
    def from_input_names(cls, input_names: list[str], windows: dict[str, int]) -> DecodeMasks:
        types = [name.split(".", 1)[1] for name in input_names if name.startswith("attention_mask.")]
        return cls(types or None, windows)

    def structured(self, valid: torch.Tensor, query_slots: torch.Tensor) -> Any:
        """The mask, or ``{layer type: mask}``, as the model's ``attention_mask`` argument."""
        if self.layer_types is None:
            return decode_mask(valid, query_slots)
        return {key: decode_mask(valid, query_slots, self.windows.get(key)) for key in self.layer_types}

    def by_input_name(self, valid: torch.Tensor, query_slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The masks by flat input name (``attention_mask`` or ``attention_mask.<layer type>``)."""
        masks = self.structured(valid, query_slots)
        if isinstance(masks, dict):
            return {f"attention_mask.{key}": mask.contiguous() for key, mask in masks.items()}
        return {"attention_mask": masks.contiguous()}


def greedy_decode(
    step: Any,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    max_cache_len: int,
    prompt_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """Greedy generation with a static-cache decode graph that takes a whole prompt and then
    one token per call.

    ``step(input_ids, valid, query_slots, position_ids) -> logits`` runs the graph and keeps its
    cache; ``valid[b, j]`` says whether cache slot ``j`` holds a real token and ``query_slots``
    are the slots the new tokens are written to (see :func:`decode_mask`). Returns
    ``[batch, prompt + new]`` token ids, like ``model.generate(do_sample=False)``: left padding
    (``prompt_mask``) is honoured and rows that produced ``eos_token_id`` are padded with
    ``pad_token_id``.
    """
    batch, prompt_len = prompt_ids.shape
    if prompt_len + max_new_tokens > max_cache_len:
        raise HfExportError(
            f"prompt ({prompt_len}) + new tokens ({max_new_tokens}) exceed the cache length {max_cache_len}"
        )
    prompt_mask = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask.long()
    valid = torch.zeros(batch, max_cache_len, dtype=torch.long)
    valid[:, :prompt_len] = prompt_mask
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    logits = step(prompt_ids, valid, torch.arange(prompt_len), positions)
    tokens = [prompt_ids]
    finished = torch.zeros(batch, dtype=torch.bool)
    next_position = positions[:, -1:] + 1
    for index in range(max_new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        if eos_token_id is not None:
            next_token = torch.where(finished[:, None], torch.full_like(next_token, pad_token_id), next_token)
            finished |= next_token[:, 0] == eos_token_id
        tokens.append(next_token)
        if index == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
            break
        slot = prompt_len + index
        valid[:, slot] = 1
        logits = step(next_token, valid, torch.tensor([slot]), next_position)
        next_position = next_position + 1
    return torch.cat(tokens, dim=1)


class DynamoDecoder:
    """``step`` for :func:`greedy_decode` over an exported decode ``ExportedProgram``: the static
    cache is a copy of the one in the program's example inputs, reset, resized to the batch, and
    updated in place by each call."""

    def __init__(self, program: torch.export.ExportedProgram, batch_size: int) -> None:
        import torch.utils._pytree as pytree

        from hfexport.pipeline.pytree import register_cache_pytrees
        from hfexport.pipeline.windowed_cache import attention_windows

        register_cache_pytrees()
        _, example = program.example_inputs
        mask = example["attention_mask"]
        self.masks = DecodeMasks(list(mask) if isinstance(mask, dict) else None, attention_windows(example))
        passed = {"input_ids", "attention_mask", "position_ids", "cache"}
        self.constants = {k: v for k, v in example.items() if k not in passed}
        self.cache = pytree.tree_map(
            lambda t: torch.zeros((batch_size, *t.shape[1:]), dtype=t.dtype) if t.dim() >= 2 else torch.zeros_like(t),
            example["cache"],
        )
        self.max_cache_len = max(t.shape[2] for t in pytree.tree_leaves(self.cache) if t.dim() == 4)
        self.module = program.module()

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            out = self.module(
                input_ids=input_ids,
                attention_mask=self.masks.structured(valid, query_slots),
                position_ids=position_ids,
                cache=self.cache,
                **self.constants,
            )
        return out.logits


class OnnxDecoder:
    """``step`` for :func:`greedy_decode` over an exported static-cache decode ``.onnx``.

    The cache buffers are allocated from the graph's own ``input.<name>`` metadata (the sample's
    shapes, with the batch axis resized) and each ``input.<name>`` / ``output.<name>`` pair is
    bound to one buffer with ONNX Runtime's IO binding, so every step reads and writes the cache
    in place, with no copies between steps.
    """

    def __init__(self, path: str | Path, batch_size: int) -> None:
        runner = OnnxRunner(path)
        self.session = runner.session
        metadata = self.session.get_modelmeta().custom_metadata_map
        shapes = json.loads(metadata.get("hfexport.sample_shapes", "{}"))
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.cache: dict[str, torch.Tensor] = {}
        for name in runner.input_names:
            if name.startswith("input."):
                path = name[len("input.") :]
                shape = shapes.get(path, [])  # scalars (token counters) have no axes
                if shape:
                    shape = [batch_size, *shape[1:]]
                self.cache[path] = torch.zeros(shape, dtype=_ORT_TYPES[types[name]])
        self.max_cache_len = max(t.shape[2] for t in self.cache.values() if t.dim() == 4)
        self.logits_name = runner.output_names[0]
        windows = json.loads(metadata.get("hfexport.attention_windows", "{}"))
        self.masks = DecodeMasks.from_input_names(runner.input_names, windows)
        self.binding = self.session.io_binding()
        for name, buffer in self.cache.items():
            self._bind(self.binding.bind_input, f"input.{name}", buffer)
            self._bind(self.binding.bind_output, f"output.{name}", buffer)

    @staticmethod
    def _bind(bind: Any, name: str, tensor: torch.Tensor) -> None:
        bind(name, "cpu", 0, _NUMPY_TYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        feed = {"input_ids": input_ids.contiguous(), "position_ids": position_ids.contiguous()}
        feed.update(self.masks.by_input_name(valid, query_slots))
        for name, tensor in feed.items():
            self._bind(self.binding.bind_input, name, tensor)
        self.binding.bind_output(self.logits_name, "cpu")  # allocated by ORT: its shape varies
        self.session.run_with_iobinding(self.binding)
        # outputs come in binding order: the cache pairs first, the logits last
        logits = self.binding.get_outputs()[-1].numpy()
        return torch.from_numpy(logits.copy())


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


class ExecutorchDecoder:
    """``step`` for :func:`greedy_decode` over an exported static-cache decode ``.pte`` saved by
    hfexport (its ``.pte.json`` names the inputs and the ``output.<name>`` cache write-backs).

    The Python runtime copies inputs into the method's planned buffers and does not expose
    binding outputs onto inputs (``Method::set_output_data_ptr`` is C++ only), so each step reads
    the updated cache back from the write-back outputs.
    """

    def __init__(self, path: str | Path, batch_size: int) -> None:
        self.runner = ExecutorchRunner(path)
        if not self.runner.sidecar:
            raise HfExportError(f"{path} has no {path}.json next to it; save the program with hfexport")
        self.outputs = self.runner.sidecar["outputs"]
        shapes = self.runner.sidecar.get("sample_shapes", {})
        written = {name[len("output.") :] for name in self.outputs if name.startswith("output.")}
        self.inputs: dict[str, torch.Tensor | None] = {}
        for name, bounds in zip(self.runner.input_names, self.runner.upper_bounds, strict=True):
            if name in written:
                shape = shapes.get(name, list(bounds))
                shape = [batch_size, *shape[1:]] if shape else []
                dtype = torch.int64 if not shape else torch.float32
                self.inputs[name] = torch.zeros(shape, dtype=dtype)
            else:
                self.inputs[name] = None
        self.cache = {name: tensor for name, tensor in self.inputs.items() if tensor is not None}
        self.max_cache_len = max(t.shape[2] for t in self.cache.values() if t.dim() == 4)
        self.logits_index = next(i for i, name in enumerate(self.outputs) if not name.startswith("output."))
        windows = self.runner.sidecar.get("attention_windows", {})
        self.masks = DecodeMasks.from_input_names(self.runner.input_names, windows)

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        fed = {"input_ids": input_ids, "position_ids": position_ids}
        fed.update(self.masks.by_input_name(valid, query_slots))
        tensors = []
        for name in self.runner.input_names:
            if name in self.cache:
                tensors.append(self.cache[name])
            elif name in fed:
                tensors.append(fed[name])
            else:
                raise HfExportError(f"the decode program takes an input {name!r} this decode loop does not provide")
        self.runner.check(tensors)
        outputs = self.runner.method.execute(tensors)
        for name, value in zip(self.outputs, outputs, strict=True):
            if name.startswith("output."):
                self.cache[name[len("output.") :]] = value.clone()
        return outputs[self.logits_index]
