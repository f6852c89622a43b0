"""Export configs: one dataclass per backend, with dict / JSON round-trips."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.errors import ConfigError
from hfexport.pipeline.pass_manager import split_pass_list


def _encode_dim(value: Any) -> Any:
    """JSON form of a ``dynamic_shapes`` entry (``Dim``, ``Dim.AUTO``, nested dicts / lists)."""
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _encode_dim(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_dim(v) for v in value]
    if value is torch.export.Dim.AUTO:
        return {"dim": "auto"}
    if value is torch.export.Dim.STATIC:
        return {"dim": "static"}
    if value is torch.export.Dim.DYNAMIC:
        return {"dim": "dynamic"}
    if hasattr(value, "__name__") and hasattr(value, "min"):
        return {"dim": value.__name__, "min": value.min, "max": value.max}
    raise ConfigError(f"cannot serialise dynamic_shapes entry {value!r}")


def _decode_dim(value: Any, dims: dict[str, Any] | None = None) -> Any:
    dims = {} if dims is None else dims
    if isinstance(value, list):
        return [_decode_dim(v, dims) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) >= {"dim"} and set(value) <= {"dim", "min", "max"}:
        name = value["dim"]
        special = {"auto": "AUTO", "static": "STATIC", "dynamic": "DYNAMIC"}
        if name in special:
            return getattr(torch.export.Dim, special[name])
        # The same name must give the same Dim object: torch.export relates axes by identity.
        if name not in dims:
            low, high = value.get("min"), value.get("max")
            if low is not None and high is not None and low > high:
                raise ConfigError(f"dynamic_shapes Dim {name!r} has min {low} above its max {high}; swap them")
            dims[name] = torch.export.Dim(name, min=low, max=high)
        return dims[name]
    return {int(k) if str(k).isdigit() else k: _decode_dim(v, dims) for k, v in value.items()}


_SIMPLE_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "Path": os.PathLike, "None": type(None)}

# the fields declared ``Any``: what each takes, and how a message says it
_PASS_LIST = "a comma-separated string of pass names, a list of pass names / Pass objects, or None"
_DYNAMIC_SHAPES = "a dict {input name: axes} (or a tuple / list, as torch.export.export takes), or None"


def check_field_types(config: Any) -> None:
    """Raise :class:`ConfigError` for a field whose value does not have its declared type: one
    line naming the field, what was given and what it takes. Plain declared types (``bool``,
    ``int | None``, ``float``, ``str``, ``str | Path | None``) are checked as declared: a JSON
    config's ``"dynamic": "no"`` is a string, not ``False``; a bool is not taken for a number; an
    int is taken for a float. ``passes`` and ``dynamic_shapes`` (declared ``Any``) are checked
    for the shapes they take."""
    from hfexport.pipeline.pass_manager import Pass

    name = type(config).__name__
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "passes":
            items = [] if value is None or isinstance(value, str) else value
            if not isinstance(value, (str, list, tuple, type(None))):
                raise ConfigError(f"{name} passes must be {_PASS_LIST}, got {_given(value)}")
            for index, item in enumerate(items):
                if not isinstance(item, (str, Pass)):
                    raise ConfigError(
                        f"{name} passes[{index}] must be a pass name (str) or a Pass object, got {_given(item)}"
                    )
            continue
        if field.name == "dynamic_shapes":
            if not isinstance(value, (dict, list, tuple, type(None))):
                raise ConfigError(f"{name} dynamic_shapes must be {_DYNAMIC_SHAPES}, got {_given(value)}")
            continue
        names = [part.strip() for part in str(field.type).split("|")]
        if not all(part in _SIMPLE_TYPES for part in names):
            continue  # a subclass's field of another type checks itself
        types = tuple(_SIMPLE_TYPES[part] for part in names)
        if float in types:
            types += (int,)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise ConfigError(f"{name} {field.name} must be {' or '.join(names)}, got {_given(value)}")


def _given(value: Any) -> str:
    """A value as a message shows it: its repr (cut to one short line) and its type."""
    shown = repr(value).replace("\n", " ")
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{shown} ({type(value).__name__})"


@dataclass
class DynamoConfig:
    """Config of :class:`~hfexport.DynamoExporter` (and base of the other backends' configs).

    Args:
        dynamic: mark every axis of every input tensor dynamic (``Dim.AUTO``).
        dynamic_shapes: explicit ``dynamic_shapes``, forwarded to ``torch.export.export``.
        prefer_deferred_runtime_asserts_over_guards: forwarded to ``torch.export.export``.
        strict: forwarded to ``torch.export.export`` (``False``: non-strict tracing).
        passes: the FX pass list; ``None`` is the backend's default list, else a list of pass
            names / :class:`~hfexport.Pass` objects or a comma-separated string of names.
        dump_dir: write per-stage and per-pass dumps and ``report.md`` under this folder (a str or a path).
        verify: after capture and after each stage, compare the program's outputs with eager
            PyTorch on the sample inputs and fail at the first stage over ``tolerance``;
            ``"passes"`` checks after every pass too and names the first pass over it.
        tolerance: max abs difference allowed by ``verify``; ``None`` is 1e-4 for a float32
            program and, for a float16 / bfloat16 one, a few units of its dtype's resolution at
            each output's magnitude (see :class:`~hfexport.pipeline.numerics.NumericsCheck`).
        dtype: the floating-point dtype of the program: ``"auto"`` (the model's own where the
            target's runtime runs it, else float32, said in one warning: a bfloat16 model for
            ONNX Runtime's CPU provider or for ExecuTorch's XNNPACK delegate, which takes float32
            and float16 only), ``"float32"``, ``"float16"`` or ``"bfloat16"``. The
            export converts a copy of the model (and its floating-point sample inputs); the
            model is not changed. A dtype the target's runtime cannot run is refused.
    """

    export_format: ClassVar[str] = "dynamo"

    dynamic: bool = False
    dynamic_shapes: Any = None
    prefer_deferred_runtime_asserts_over_guards: bool = False
    strict: bool = False
    passes: Any = None
    dump_dir: str | Path | None = None
    verify: bool | str = False
    tolerance: float | None = None
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.verify not in (True, False, "passes") or not isinstance(self.verify, (bool, str)):
            given = _given(self.verify)
            raise ConfigError(f"{type(self).__name__} verify must be True, False or 'passes', got {given}")
        check_field_types(self)
        if self.passes is not None:
            self.passes = split_pass_list(self.passes)
        if self.dynamic and self.dynamic_shapes is not None:
            raise ConfigError("set either dynamic=True (every axis dynamic) or explicit dynamic_shapes, not both")
        if self.dump_dir is not None:
            self.dump_dir = str(self.dump_dir)
            if Path(self.dump_dir).exists() and not Path(self.dump_dir).is_dir():
                raise ConfigError(f"dump_dir {self.dump_dir} is a file; give a folder for the dumps")
        if self.tolerance is not None and not 0 < self.tolerance < float("inf"):
            raise ConfigError(
                f"tolerance must be a positive number (the largest absolute difference), got {self.tolerance!r}"
            )
        from hfexport.precision import check_dtype

        check_dtype(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict, including ``export_format``; inverse of :meth:`from_dict`."""
        data: dict[str, Any] = {"export_format": self.export_format}
        for name in self.field_names():
            value = getattr(self, name)
            if name == "dynamic_shapes":
                value = _encode_dim(value)
            elif name == "passes" and value is not None:
                value = [_pass_name(p) for p in value]
            data[name] = value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DynamoConfig:
        """Build a config from :meth:`to_dict` output; unknown keys raise :class:`ConfigError`."""
        data = dict(data)
        export_format = data.pop("export_format", cls.export_format)
        if export_format != cls.export_format:
            raise ConfigError(
                f"{cls.__name__} is for export_format {cls.export_format!r}, got {export_format!r}; "
                "use AutoExportConfig.from_dict to pick the config class from the format"
            )
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown {cls.__name__} key(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(cls.field_names())}"
            )
        if "dynamic_shapes" in data:
            data["dynamic_shapes"] = _decode_dim(data["dynamic_shapes"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> DynamoConfig:
        return cls.from_dict(json.loads(text))


def _pass_name(item: Any) -> str:
    from hfexport.pipeline.pass_manager import get_pass

    name = item if isinstance(item, str) else getattr(item, "name", None)
    if not isinstance(item, str) and (name is None or get_pass(name, missing_ok=True) is not item):
        raise ConfigError(
            f"pass {item!r} is not registered, so the config cannot be serialised; "
            "register it with hfexport.register_pass to refer to it by name"
        )
    return name


# SmolLM2-135M-Instruct int4 in og.Generator (benchmarks/results/runtime-loops/README.md): blocks of 64 decode at
# 1.03x the ONNX Runtime GenAI builder's symmetric blocks of 32, blocks of 32 at 0.95x (a step reads half the scales
# and zero points), and stay nearer fp32 than the builder's (KL 0.289 against 0.306; blocks of 32: 0.244)
ONNX_INT4_GROUP_SIZE = 64


@dataclass
class OnnxConfig(DynamoConfig):
    """Config of :class:`~hfexport.OnnxExporter`: the :class:`DynamoConfig` fields plus

    Args:
        opset_version: the ONNX opset; ``None`` is the newest the installed onnxscript supports.
        optimize: run the onnxscript optimizer and ONNX Runtime's fusions of RMS norms, rotary
            embeddings and static-cache attention, and the packing of projections that read one
            input (the ``onnx_optimizer``, ``onnx_ort_fusions``, ``onnx_group_query_attention``,
            ``onnx_packed_projections`` and ``onnx_packed_attention_inputs`` passes) when
            ``passes`` is the default list; with
            an explicit ``passes`` list, list them or not.
        quantize: ``None`` (fp32), ``"int4"`` (4-bit weights in blocks of ``quantize_group_size``
            with a scale and a zero point each, ONNX Runtime ``MatMulNBits``, inputs quantized
            to int8 on the fly: the ``onnx_int4_weights`` pass) or ``"int8"`` (int8
            weights and dynamically quantized activations: ``onnx_int8_dynamic``), appended to the
            pass list. ``verify`` then checks the logits' cosine similarity (at least 0.98) and
            reports it with the top-1 agreement.
        quantize_group_size: the int4 block size (a power of two, at least 16; 64 by default).
        genai: give a decoder-only decode graph ONNX Runtime GenAI's interface (the
            ``genai_io`` stage, after ``onnx_passes``) so ``og.Generator`` runs the export
            folder, which then holds a ``genai_config.json``; hfexport's own loops run it too.
            ``False`` keeps the spec's interface (4-D masks and token counters fed by the loop).
    """

    export_format: ClassVar[str] = "onnx"

    opset_version: int | None = None
    optimize: bool = True
    quantize: str | None = None
    quantize_group_size: int = ONNX_INT4_GROUP_SIZE
    genai: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.genai, bool):
            raise ConfigError(f"OnnxConfig genai must be True or False, got {_given(self.genai)}")
        if self.quantize not in (None, "int4", "int8"):
            raise ConfigError(f"OnnxConfig quantize must be None, 'int4' or 'int8', got {self.quantize!r}")
        size = self.quantize_group_size
        if self.quantize == "int4" and (not isinstance(size, int) or size < 16 or size & (size - 1)):
            # ONNX Runtime's MatMulNBits takes blocks of a power of two from 16
            raise ConfigError(f"OnnxConfig quantize_group_size must be a power of two of at least 16, got {size!r}")
        if self.opset_version is not None:
            latest = latest_onnx_opset()
            if not MIN_ONNX_OPSET <= self.opset_version <= (latest or self.opset_version):
                upper = f"through {latest}" if latest else "or later"
                raise ConfigError(
                    f"OnnxConfig opset_version must be an int from {MIN_ONNX_OPSET} {upper} (torch.onnx's exporter "
                    f"writes opset {MIN_ONNX_OPSET} and converts upwards), got {self.opset_version!r}; "
                    "None keeps torch.onnx's default"
                )


# torch.onnx's dynamo exporter writes this opset (torch/onnx/_internal/exporter/_constants.py) and
# its version converter goes no lower
MIN_ONNX_OPSET = 18


def latest_onnx_opset() -> int | None:
    """The newest opset the installed onnx package knows (``None`` without onnx)."""
    try:
        import onnx
    except ImportError:
        return None
    return int(onnx.defs.onnx_opset_version())


# the ExecuTorch backends hfexport's lowering delegates to ("portable": none, every op on portable kernels)
EXECUTORCH_BACKENDS = ("xnnpack", "portable")


def cuda_backend_missing() -> list[str]:
    """What ExecuTorch's CUDA backend needs and this machine has not: a CUDA build of PyTorch, a
    visible device, the ``executorch.backends.cuda`` package and triton, which it imports. The
    packages are looked up, not imported."""
    import importlib.util

    missing = []
    if torch.version.cuda is None:
        missing.append(f"a CUDA build of PyTorch (this one is {torch.__version__})")
    elif not torch.cuda.is_available():
        missing.append("a visible CUDA device")
    for module, what in (
        ("executorch.backends.cuda", "ExecuTorch's CUDA backend"),
        ("triton", "which executorch.backends.cuda imports"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(f"the {module} package ({what})")
    return missing


def refuse_cuda_backend() -> None:
    """Raise the :class:`ConfigError` of ``ExecutorchConfig(backend="cuda")``: hfexport's lowering
    does not delegate to ExecuTorch's CUDA backend (an AOTInductor delegate whose kernels go to a
    ``.ptd`` file beside the ``.pte``), and the message names what else this machine lacks for it."""
    missing = cuda_backend_missing()
    also = f", which would also need {'; '.join(missing)}" if missing else ""
    raise ConfigError(
        "ExecutorchConfig backend 'cuda' is refused: hfexport's ExecuTorch lowering delegates to XNNPACK or to "
        f"nothing (portable), not to ExecuTorch's CUDA backend{also}; use backend='xnnpack' (CPU) or 'portable'"
    )


DEFAULT_MAX_SEQ_LEN = 1024
DEFAULT_MAX_BATCH_SIZE = 8


@dataclass
class ExecutorchConfig(DynamoConfig):
    """Config of :class:`~hfexport.ExecutorchExporter`: the :class:`DynamoConfig` fields plus

    Args:
        backend: ``"xnnpack"`` (CPU, default) or ``"portable"`` (no delegation: every op on
            ExecuTorch's portable kernels). ``"cuda"`` is refused when the config is built, naming
            what is missing (:func:`refuse_cuda_backend`): hfexport's lowering does not delegate
            to ExecuTorch's CUDA backend.
        alloc_graph_input: forwarded to ExecuTorch's memory planning: whether the planner
            allocates the graph's inputs (``False``: the caller provides them).
        alloc_graph_output: likewise for the graph's outputs.
        alloc_mutable_buffers: likewise for the program's mutable buffers.
        max_seq_len: upper bound of every unbounded dynamic axis other than the batch axis;
            ``None`` is 1024, capped by the model config's own length limit
            (``max_position_embeddings``, ``n_positions``, ``max_target_positions``, …) when it has one;
            for generation components that write a static cache, the cache length.
        max_batch_size: upper bound of every unbounded dynamic batch axis (axis 0); ``None`` is 8,
            and 1 for generation components that write a static cache: their decode program then
            has a static batch of one, which lets XNNPACK delegate each layer whole (its reshapes
            take one dynamic axis, the query length), and the sample is cut to its first row.
        cache_in_program: keep a static cache's keys and values inside the program as its state
            (mutable buffers written in place) rather than inputs the program writes back; the
            decode step then copies no cache in or out. Without ``alloc_graph_input`` the caller
            binds its own cache buffers, so the cache stays an input.
        max_planned_memory_mb: the largest memory plan accepted (MiB, all planned buffers of the
            program); ``None`` is half of this machine's memory. A program over it is an error
            before serialising, naming the bounds to lower.
        quantize: ``None`` (fp32), ``"8da4w"`` (symmetric 4-bit weight groups of ``quantize_group_size``,
            inputs quantized to int8 per token at run time: the ``int4_weights_int8_activations``
            pass) or ``"8da8w"`` (int8 weights per output channel:
            ``int8_weights_int8_activations``), appended to the pass list; ``"int4"`` and
            ``"int8"`` (the :class:`OnnxConfig` names) mean the same. XNNPACK runs the quantized
            linear layers. ``verify`` then checks the logits' cosine similarity (at least 0.98)
            and reports it with the top-1 agreement.
        quantize_group_size: the 8da4w group size (a multiple of 32, for XNNPACK).
        llm_runner: give a decoder-only decode program the interface of ExecuTorch's LLM runner
            (the ``llm_runner_io`` stage, after ``program_state``): ``forward(input_ids,
            cache_position) → logits`` with the cache inside and the runner's constant methods, so
            ``TextLLMRunner`` (and ``llama_main``, the demo apps) runs the ``.pte`` with the
            tokenizer beside it; hfexport's own loops run it too. ``False`` keeps the spec's
            interface (masks, positions and token counters fed by the loop). Needs
            ``cache_in_program`` and ``alloc_graph_input``.

    ExecuTorch plans memory for the largest allowed shapes, so every dynamic axis needs an upper
    bound: an explicit ``Dim(max=...)`` is kept, and an unbounded axis (``dynamic=True``, or a
    ``Dim`` without ``max``) gets ``max_batch_size`` (axis 0) or ``max_seq_len`` (other axes), never
    below the sample's size. The bounds and the planned memory are logged and written to the report.
    """

    export_format: ClassVar[str] = "executorch"

    backend: str = "xnnpack"
    alloc_graph_input: bool = True
    alloc_graph_output: bool = True
    alloc_mutable_buffers: bool = True
    max_seq_len: int | None = None
    max_batch_size: int | None = None
    max_planned_memory_mb: int | None = None
    quantize: str | None = None
    quantize_group_size: int = 32
    cache_in_program: bool = True
    llm_runner: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.llm_runner, bool):
            raise ConfigError(f"ExecutorchConfig llm_runner must be True or False, got {_given(self.llm_runner)}")
        if self.llm_runner and not (self.cache_in_program and self.alloc_graph_input):
            raise ConfigError(
                "ExecutorchConfig llm_runner=True keeps the cache inside the program (ExecuTorch's LLM runner feeds "
                "none): it needs cache_in_program=True and alloc_graph_input=True"
            )
        if self.quantize not in (None, "8da4w", "8da8w", "int4", "int8"):
            raise ConfigError(
                f"ExecutorchConfig quantize must be None, '8da4w' (or 'int4') or '8da8w' (or 'int8'), "
                f"got {self.quantize!r}"
            )
        if self.quantize and self.dtype == "bfloat16":
            raise ConfigError(
                f"ExecutorchConfig quantize={self.quantize!r} with dtype 'bfloat16': XNNPACK's quantized linears take "
                "float32 or float16 activations; use dtype 'auto' or 'float32'"
            )
        for name in ("max_seq_len", "max_batch_size", "max_planned_memory_mb", "quantize_group_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"ExecutorchConfig {name} must be at least 1, got {value}")
        if self.quantize in ("8da4w", "int4") and self.quantize_group_size % 32:
            # executorch/backends/xnnpack/operators/node_visitor.py asserts it at delegation
            raise ConfigError(
                "ExecutorchConfig quantize_group_size must be a multiple of 32 for 4-bit weights (XNNPACK's "
                f"kernels take such groups), got {self.quantize_group_size}"
            )
        if self.backend == "cuda":
            refuse_cuda_backend()
        if self.backend not in EXECUTORCH_BACKENDS:
            raise ConfigError(
                f"unknown ExecuTorch backend {self.backend!r}; valid backends: {', '.join(EXECUTORCH_BACKENDS)}"
            )
