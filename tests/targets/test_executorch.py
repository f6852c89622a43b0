"""ExecutorchExporter end to end with the real ExecuTorch runtime on the saved .pte."""

import pytest
import torch
from models import build, eager, main_output, sample_inputs

from hfexport import (
    ArtifactError,
    AutoExportConfig,
    AutoHfExporter,
    ConfigError,
    ExecutorchConfig,
    ExecutorchExporter,
    ExecutorchRunner,
    ExportFolder,
    HfExportError,
    register_pass,
    save_export,
)

SHAPES = [(2, 8), (3, 13), (1, 5), (2, 80)]


# tiny-qwen3-moe and tiny-phi3 (36 s each) run under make test-all: make test took 29 of its 30 minutes
@pytest.mark.parametrize(
    "preset",
    [
        "tiny-llama",
        "tiny-qwen3",
        pytest.param("tiny-qwen3-moe", marks=pytest.mark.slow),
        pytest.param("tiny-phi3", marks=pytest.mark.slow),
        "tiny-gpt2",
        "tiny-bert",
    ],
)
def test_executorch_runtime_matches_eager(preset, tmp_path):
    model = build(preset)
    result = ExecutorchExporter().run(model, sample_inputs(model, 2, 8), ExecutorchConfig(dynamic=True))
    save_export(tmp_path, {"model": result})
    runner = ExportFolder(tmp_path).runner()
    for batch, seq in SHAPES:  # 80 is within the bound (max_position_embeddings = 512)
        inputs = sample_inputs(model, batch, seq, seed=batch + seq)
        got = runner.run(inputs)[0]
        torch.testing.assert_close(got, main_output(eager(model, inputs)), atol=1e-4, rtol=0)
    assert result.record("capture").counts == {"max_batch_size": 8, "max_seq_len": 512}  # 512: the config's limit
    assert 0 < result.record("to_executorch").counts["planned_memory_mb"] < 1024


def test_delegation_serializes_the_programs_own_weights_not_copies_of_them(monkeypatch, tmp_path):
    # to_backend deep-copied each partition's program, weights included, before XNNPACK kept its own
    # bytes of each: a third copy of the weights at the delegate stage (SmolLM2 fp32: 1.29 -> 2.42 GB)
    import executorch.backends.xnnpack.operators.node_visitor as visitors

    from hfexport.targets.executorch import lowering

    def storages(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}

    own, served = set(), []
    read_weight, delegate = visitors.get_param_tensor, lowering.delegate

    def reading(program, node):
        weight = read_weight(program, node)
        served.extend(storages([weight]))
        return weight

    def delegating(edge, partitioners, run):
        program = edge.exported_program()
        own.update(storages([*program.state_dict.values(), *program.constants.values()]))
        return delegate(edge, partitioners, run)

    monkeypatch.setattr(visitors, "get_param_tensor", reading)
    monkeypatch.setattr(lowering, "delegate", delegating)
    model = build("tiny-llama")
    result = ExecutorchExporter().run(model, sample_inputs(model, 2, 8), ExecutorchConfig(dynamic=True))
    assert len(served) >= 2 * model.config.num_hidden_layers  # every layer's linear weights, at least
    assert set(served) <= own
    save_export(tmp_path, {"model": result})
    inputs = sample_inputs(model, 2, 8, seed=3)
    got = ExportFolder(tmp_path).runner().run(inputs)[0]
    torch.testing.assert_close(got, main_output(eager(model, inputs)), atol=1e-4, rtol=0)


def test_the_pte_is_written_from_views_of_the_models_weights_not_copies_of_them(tmp_path, monkeypatch):
    # XNNPACK's node visitors and the emitter took bytes() of every weight, and the delegation deep-copied
    # a tied embedding table (the lm_head's and the embedding's): one to two more copies of the weights
    # while the .pte was assembled (Llama-3.2-1B's shape in float32: 12.2 GB peak, 5.3 of them program)
    import hashlib

    from hfexport.targets.executorch import shared_weights

    hashed, sha256 = [], hashlib.sha256

    def counted(data=b"", **kwargs):  # the bytes each SHA-256 is taken of
        hashed.append(memoryview(data).nbytes)
        return sha256(data, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", counted)
    model = build("tiny-llama", tie_word_embeddings=True, vocab_size=333)  # a table of a size of its own
    table = model.get_input_embeddings().weight
    result = ExecutorchExporter().run(model, sample_inputs(model, 2, 8), ExecutorchConfig(dynamic=True))
    # the tied table's SHA-256, XNNPACK's key for its lm_head, is the emitter's for its embedding: taken once
    assert hashed.count(table.nbytes) == 1
    pieces = result.program._pte_data._buffers
    viewed = [piece for piece in pieces if isinstance(piece, memoryview)]
    assert all(piece.readonly for piece in viewed)
    read_from = [piece.obj.__array_interface__["data"][0] for piece in viewed]
    # every linear weight is read from the model's own storage, the tied table twice (the delegate's
    # lm_head and the portable embedding)
    for name, weight in model.named_parameters():
        if weight.dim() == 2:
            assert read_from.count(weight.untyped_storage().data_ptr()) == (2 if weight is table else 1), name
    own = {weight.untyped_storage().data_ptr() for weight in model.parameters()}
    program = result.program.exported_program()
    copies = [
        name for name, t in program.state_dict.items() if t.nbytes > 1024 and t.untyped_storage().data_ptr() not in own
    ]
    assert not copies  # the delegation's duplicate of the tied table (p_lm_head_weight_copy_0) shares it
    assert not shared_weights._VIEWABLE  # views are taken only while the program is lowered
    save_export(tmp_path, {"model": result})
    inputs = sample_inputs(model, 2, 8, seed=3)
    got = ExportFolder(tmp_path).runner().run(inputs)[0]
    torch.testing.assert_close(got, main_output(eager(model, inputs)), atol=1e-4, rtol=0)


def test_a_weights_hash_is_taken_again_in_the_next_lowering(tmp_path, monkeypatch):
    # the emitter takes XNNPACK's hash of a weight it hashed in the same lowering; a later export
    # hashes again, even a weight changed through .data (which leaves its version as it was)
    import hashlib

    hashed, sha256 = [], hashlib.sha256

    def counted(data=b"", **kwargs):
        hashed.append(memoryview(data).nbytes)
        return sha256(data, **kwargs)

    monkeypatch.setattr(hashlib, "sha256", counted)
    model = build("tiny-llama", tie_word_embeddings=True, vocab_size=333)
    table = model.get_input_embeddings().weight
    inputs = sample_inputs(model, 1, 8)
    ExecutorchExporter().run(model, inputs, ExecutorchConfig(dynamic=True))
    assert hashed.count(table.nbytes) == 1
    table.data.mul_(2)
    result = ExecutorchExporter().run(model, inputs, ExecutorchConfig(dynamic=True))
    assert hashed.count(table.nbytes) == 2
    assert sha256(table.detach().numpy().tobytes()).hexdigest().encode() in bytes(result.program.buffer)


def test_a_program_whose_weights_changed_after_the_export_is_not_written(tmp_path):
    model = build("tiny-llama")
    program = ExecutorchExporter().export(model, sample_inputs(model, 1, 4))
    program.save(str(tmp_path / "before.pte"))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    with pytest.raises(ArtifactError, match="1 of this ExecuTorch program's weights were changed in place after"):
        program.save(str(tmp_path / "after.pte"))
    assert not (tmp_path / "after.pte").exists()
    with pytest.raises(ArtifactError, match="save the program before changing the model, or export again"):
        len(program.buffer)


def test_a_pte_that_fails_to_be_written_leaves_no_file_that_looks_valid(tmp_path, monkeypatch):
    # ExecutorchProgramManager.save logs an error in writing and returns: the export folder got a
    # truncated model.pte and its manifest
    from executorch.exir import ExecutorchProgramManager

    model = build("tiny-llama")
    result = ExecutorchExporter().run(model, sample_inputs(model, 1, 4), ExecutorchConfig())

    def disk_full(self, file):
        file.write(b"\0" * 64)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ExecutorchProgramManager, "write_to_file", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        save_export(tmp_path / "out", {"model": result})
    with pytest.raises(OSError, match="No space left on device"):
        result.program.save(str(tmp_path / "model.pte"))  # the spec's et_program.save
    assert not list((tmp_path / "out").glob("**/*.pte")) and not list((tmp_path / "out").glob("**/hfexport.json"))


def test_spec_example_runs_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = build("tiny-qwen3")
    inputs = sample_inputs(model, 1, 6)  # stands in for tokenizer("Hello, world!", return_tensors="pt")

    exporter = ExecutorchExporter()
    config = ExecutorchConfig(backend="xnnpack", dynamic=True)
    et_program = exporter.export(model, inputs, config=config)

    # save for on-device deployment
    et_program.save("model.pte")

    # load and run via the ExecuTorch Python runtime
    from executorch.runtime import Runtime

    program = Runtime.get().load_program("model.pte")
    method = program.load_method("forward")
    outputs = method.execute(list(inputs.values()))

    torch.testing.assert_close(outputs[0], eager(model, inputs).logits, atol=1e-4, rtol=0)


def test_spec_explicit_dynamic_shapes_example_and_out_of_bounds_error(tmp_path):
    model = build("tiny-llama")
    inputs = sample_inputs(model, 2, 8)
    inputs["attention_mask"][1, :5] = 0

    batch = torch.export.Dim("batch", min=1, max=32)
    seq = torch.export.Dim("seq", min=1, max=64)

    exporter = ExecutorchExporter()
    config = ExecutorchConfig(
        backend="xnnpack",
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    result = exporter.run(model, inputs, config=config)
    result.program.save(str(tmp_path / "model.pte"))
    # hfexport's own save writes the manifest next to the program: input names, order and bounds
    save_export(tmp_path / "named", {"model": result})
    runner = ExportFolder(tmp_path / "named").runner()
    for shape in [(2, 8), (4, 21)]:
        sample = sample_inputs(model, *shape, seed=5)
        torch.testing.assert_close(runner.run(sample)[0], eager(model, sample).logits, atol=1e-4, rtol=0)
    with pytest.raises(HfExportError, match="input 'input_ids' axis 1 has size 80, above the exported upper bound 64"):
        runner.run(sample_inputs(model, 2, 80))
    # a bare .pte takes its inputs by position: without the manifest their names are unknown
    with pytest.raises(HfExportError, match="without hfexport's manifest"):
        ExecutorchRunner(tmp_path / "model.pte")
    axes = {(a.input, a.axis): a for a in result.input_axes}
    assert axes[("input_ids", 1)].max == 64


def test_unbounded_axes_get_the_documented_bounds():
    model = build("tiny-gpt2")
    result = ExecutorchExporter().run(model, sample_inputs(model), ExecutorchConfig(dynamic=True, max_seq_len=40))
    axes = {(a.input, a.axis): a for a in result.input_axes}
    assert axes[("input_ids", 0)].max == 8 and axes[("input_ids", 1)].max == 40
    assert "max_seq_len=40" in result.report
    runner = ExecutorchRunner(result.program)
    with pytest.raises(HfExportError, match="axis 1 has size 41, above the exported upper bound 40"):
        runner.run(sample_inputs(model, 1, 41))


def test_the_cuda_backend_is_refused_when_the_config_is_built_naming_what_is_missing(monkeypatch):
    import importlib.util

    from hfexport import configs

    with pytest.raises(ConfigError) as caught:
        ExecutorchConfig(backend="cuda")
    message = str(caught.value)
    assert "\n" not in message
    assert "not to ExecuTorch's CUDA backend" in message and "use backend='xnnpack' (CPU) or 'portable'" in message
    if torch.version.cuda is None:
        assert f"a CUDA build of PyTorch (this one is {torch.__version__})" in message
    if importlib.util.find_spec("triton") is None:
        assert "the triton package" in message
    # with everything ExecuTorch's CUDA backend needs, hfexport's lowering still has no CUDA path
    monkeypatch.setattr(configs, "cuda_backend_missing", lambda: [])
    with pytest.raises(ConfigError, match=r"not to ExecuTorch's CUDA backend; use backend='xnnpack'"):
        ExecutorchConfig(backend="cuda")
    assert ExecutorchConfig(backend="portable").backend == "portable"
    with pytest.raises(ConfigError, match="valid backends: xnnpack, portable$"):
        ExecutorchConfig(backend="vulkan")


def test_delegation_summary_shows_linear_layers_on_xnnpack(tmp_path):
    model = build("tiny-llama")
    result = ExecutorchExporter().run(model, sample_inputs(model), ExecutorchConfig(dynamic=True, dump_dir=tmp_path))
    summary = (tmp_path / "05_delegate" / "delegation.md").read_text()
    # q, k, v, o, gate, up, down per layer, and lm_head; the 2 x 2 + 1 RMSNorm means, which
    # last_axis_mean_as_linear turns into one-output linear layers XNNPACK takes; and the 2 x 2
    # rotate_half calls of the queries' and keys' rotary embedding (rotate_half_as_linear)
    linears = 2 * 7 + 1 + 5 + 2 * 2
    assert f"| aten_linear_default | {linears} | 0 |" in summary
    assert "aten_mean_dim" not in summary
    assert result.record("delegate").counts["delegated_nodes"] > 0
    assert (tmp_path / "06_to_executorch" / "program.pte").is_file()


def test_xnnpack_re_traces_a_partition_only_when_one_of_its_passes_changed_it(monkeypatch):
    # XNNPACK's preprocess ran 17 passes over each partition, 14 of which re-traced it whole and
    # reported it modified whatever they found (a Llama-3.2-1B-shaped export: 10 of its 17
    # delegate seconds). A pass that finds nothing now leaves the graph the last re-trace made;
    # one that rewrites it (the ReLU fused into the linear layer before it) re-traces it
    from executorch.exir.pass_base import _ExportPassBase

    traced = []
    retrace = _ExportPassBase.call

    def counted(self, graph_module):
        if type(self).__module__.startswith("executorch.backends.xnnpack."):
            traced.append(type(self).__name__)
        return retrace(self, graph_module)

    monkeypatch.setattr(_ExportPassBase, "call", counted)  # under the patch: the re-traces that run
    model = build("tiny-llama")
    result = ExecutorchExporter().run(model, sample_inputs(model), ExecutorchConfig(dynamic=True, verify=True))
    partitions = len(result.program.executorch_program.execution_plan[0].delegates)
    assert partitions and len(traced) <= partitions, (partitions, sorted(set(traced)))  # 14 each before
    assert result.record("to_executorch").max_abs_diff <= 1e-4

    traced.clear()
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    result = ExecutorchExporter().run(layers, {"input": torch.randn(2, 8)}, ExecutorchConfig(verify=True))
    assert "FuseActivationPass" in traced
    assert result.record("to_executorch").max_abs_diff <= 1e-5


def test_a_re_trace_reuses_only_the_results_of_nodes_no_pass_changed_since_the_last_one(calls_counted):
    # every ExportPass re-trace ran each node's op again under fake tensors for its result's sizes
    # (a Llama-3.2-1B-shaped export: to_edge 12.8 s, delegate 9.6 s; now 7.9 and 7.0). A node the
    # last re-trace computed takes its result again, unless a pass changed the node since, or the
    # sizes of what it reads: then it and what reads it run again
    from executorch.exir.pass_base import ExportPass
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hfexport.targets.executorch.retraces  # noqa: F401  (registers the patches)
    from hfexport.pipeline.patches import patches_applied

    class Two(torch.nn.Module):
        def forward(self, x, y):
            return (x.relu() * 2).sum(0), y + 1

    program = torch.export.export(Two(), (torch.randn(2, 3), torch.randn(3, 2)))
    dispatched = calls_counted(FakeTensorMode, "dispatch")
    with patches_applied(scope="to_edge"):
        module = ExportPass()(program.graph_module).graph_module
        first = len(dispatched)
        module = ExportPass()(module).graph_module
        assert first >= 4 and len(dispatched) == first  # relu, mul, sum, add: none ran again
        relu = next(n for n in module.graph.nodes if n.target is torch.ops.aten.relu.default)
        y = next(n for n in module.graph.nodes if n.op == "placeholder" and n.name == "y")
        relu.replace_input_with(relu.args[0], y)  # a pass's rewrite that leaves the node's result as it was
        module = ExportPass()(module).graph_module
    assert len(dispatched) == first + 3  # relu, and mul and sum over its new sizes; not add
    sizes = {str(n.target): tuple(n.meta["val"].shape) for n in module.graph.nodes if n.op == "call_function"}
    assert sizes["aten.relu.default"] == sizes["aten.mul.Tensor"] == (3, 2) and sizes["aten.sum.dim_IntList"] == (2,)


def test_a_re_trace_reuses_a_delegates_outputs_when_its_inputs_are_as_before(calls_counted):
    # every ExportPass re-trace of a lowered program (the emitter's passes: a Llama-3.2-1B-shaped
    # export's to_executorch spent 1.1 of its 2.6 s there) ran each delegate's original program
    # under fake tensors again for its outputs' sizes; the delegate's outputs are now the last
    # re-trace's when its lowered module and its inputs' metadata are as they were
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.pass_base import ExportPass

    import hfexport.targets.executorch.retraces  # noqa: F401  (registers the patches)
    from hfexport.pipeline.patches import patches_applied

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.second(self.first(x).cumsum(1))  # cumsum: no XNNPACK op, two delegates

    program = torch.export.export(Two(), (torch.randn(3, 4),))
    lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).exported_program()
    module = lowered.graph_module
    delegates = [n for n in module.graph.nodes if "call_delegate" in str(n.target)]
    assert len(delegates) == 2
    unlifted = calls_counted(torch.export.ExportedProgram, "module")  # a delegate's run unlifts its program
    with patches_applied(scope="to_executorch"):
        module = ExportPass()(module).graph_module
        assert len(unlifted) == 2
        for _ in range(2):
            module = ExportPass()(module).graph_module
        assert len(unlifted) == 2  # neither ran again
        cumsum = next(n for n in module.graph.nodes if "cumsum" in str(n.target))
        cumsum.update_arg(1, 0)  # the second delegate's input keeps its sizes: reused still
        module = ExportPass()(module).graph_module
        assert len(unlifted) == 2
    outputs = [n for n in module.graph.nodes if "call_delegate" in str(n.target)]
    assert [tuple(n.meta["val"][0].shape) for n in outputs] == [(3, 4), (3, 2)]


def test_xnnpacks_pattern_passes_build_their_patterns_only_for_a_partition_that_can_match(calls_counted):
    # XNNPACK's SDPA and bilinear-upsample passes exported and lowered their pattern modules (1.9 s
    # of a Llama-3.2-1B-shaped export) to search partitions that hold none of their ops
    from executorch.backends.xnnpack._passes import convert_to_sdpa, convert_to_upsample_bilinear2d
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    import hfexport.targets.executorch.retraces  # noqa: F401  (registers the patches)
    from hfexport.pipeline.patches import patches_applied

    sdpa = calls_counted(convert_to_sdpa.sdpa, "get_graphs")
    bilinear = calls_counted(convert_to_upsample_bilinear2d.bilinear_2d, "get_graphs_dict")

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v

    x = torch.randn(2, 4, 8)
    for module, inputs, built in (
        (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), (x,), 0),
        (Attention(), (x, x, x), 1),  # a softmax: the SDPA pass looks for its pattern
    ):
        with patches_applied(scope="delegate"):
            lowered = to_edge_transform_and_lower(
                torch.export.export(module, inputs), partitioner=[XnnpackPartitioner()]
            )
        got = lowered.to_executorch()
        assert len(sdpa) == built and not bilinear
        from executorch.runtime import Runtime

        method = Runtime.get().load_program(got.buffer).load_method("forward")
        torch.testing.assert_close(method.execute(list(inputs))[0], module(*inputs), rtol=1e-5, atol=1e-5)


def test_a_lowering_stage_compiles_each_generated_source_once(monkeypatch):
    # every GraphModule recompile compiled its generated source, and the lowering recompiles the
    # same graphs again and again (a Llama-3.2-1B-shaped export: 2,604 sources, 173 different).
    # In a stage, a source compiled before runs its code again; a changed graph gets its own
    import builtins

    import hfexport.targets.executorch.retraces  # noqa: F401  (registers the patches)
    from hfexport.pipeline.patches import patches_applied

    compiled = []
    original = builtins.compile

    def compiling(source, *args, **kwargs):
        if isinstance(source, str) and "def forward(self" in source:  # a graph module's
            compiled.append(source)
        return original(source, *args, **kwargs)

    monkeypatch.setattr(builtins, "compile", compiling)
    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    x = torch.randn(3)
    with patches_applied(scope="delegate"):
        compiled.clear()  # applying the patches imports modules that make graph modules
        for _ in range(3):
            module.recompile()
        assert len(compiled) == 1 and torch.equal(module(x), x.relu().tanh())
        copy = torch.fx.GraphModule(module, module.graph)  # another module of the same graph
        assert len(compiled) == 1 and torch.equal(copy(x), x.relu().tanh())
        tanh = next(n for n in module.graph.nodes if n.op == "call_module" and n.target == "1")
        tanh.replace_all_uses_with(tanh.args[0])
        module.graph.erase_node(tanh)
        module.recompile()
        assert len(compiled) == 2 and torch.equal(module(x), x.relu())
        assert torch.equal(copy(x), x.relu().tanh())  # its own globals and code still
    module.recompile()  # outside the stage: compiled as before
    assert len(compiled) == 3


def test_an_8da4w_lowering_runs_torchaos_quantization_code_once_per_shape_and_writes_the_same_pte(
    monkeypatch, tmp_path, calls_counted
):
    # every re-trace of an 8da4w program (the edge passes, XNNPACK's preprocess, the emitter's
    # passes and the delegates' programs they re-run) ran torchao's Python code for each quantized
    # linear layer under fake tensors, only for its results' sizes (a Llama-3.2-1B-shaped export's
    # lowering stages: 57 s, 42 s without). A call with an earlier one's inputs' sizes reuses its results'
    import torchao.quantization.quant_primitives as primitives

    from hfexport.targets.executorch import retraces

    ran = calls_counted(primitives, "_quantize_affine_no_dtype_cast")
    model = build("tiny-llama")
    inputs = sample_inputs(model, 1, 8)
    written = {}
    for reused in (True, False):
        if not reused:
            monkeypatch.setattr(retraces, "_quantization_ops", frozenset, raising=False)
        ran.clear()
        result = ExecutorchExporter().run(model, inputs, ExecutorchConfig(dynamic=True, quantize="8da4w"))
        save_export(tmp_path / str(reused), {"model": result})
        written[reused] = ((tmp_path / str(reused) / "model.pte").read_bytes(), len(ran))
    (pte, runs), (pte_before, runs_before) = written[True], written[False]
    assert pte == pte_before  # the same program, byte for byte
    assert runs * 4 <= runs_before, (runs, runs_before)


class _Accumulating(torch.nn.Module):
    """A linear layer whose output a buffer sums in place: its capture needs functionalizing."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(2, 8))

    def forward(self, x):
        y = self.proj(x)
        self.total.add_(y)
        return torch.nn.functional.layer_norm(self.total + y, (8,))


def test_to_edge_decomposes_once_and_again_only_when_the_partitioner_refuses_an_op_it_kept(monkeypatch, calls_counted):
    # ExecuTorch's edge conversion re-traced the whole program three times (to functionalize it,
    # to decompose it keeping XNNPACK's ops whole, and to decompose those XNNPACK then refused):
    # 10.6 of a Llama-3.2-1B-shaped export's 19.6 to_edge seconds. Now once, and a second time
    # only when the partitioner refuses a linear layer it asked to keep whole
    import copy

    import torch.export.exported_program as exported_program
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from hfexport.targets.executorch import lowering

    decompositions = calls_counted(exported_program, "_decompose_exported_program")
    torch.manual_seed(0)
    model, x = _Accumulating().eval(), torch.randn(2, 8)
    expected = copy.deepcopy(model)(x)
    configs = [lowering._refusing(c, lambda node: True) if c is LinearConfig else c for c in ALL_PARTITIONER_CONFIGS]
    refusing_linear = XnnpackPartitioner(configs=configs)
    for partitioner, runs, kept in ((lowering.partitioners("xnnpack")[0], 1, True), (refusing_linear, 2, False)):
        decompositions.clear()
        edge = lowering.to_edge(torch.export.export(copy.deepcopy(model), (x,)), [partitioner]).exported_program()
        calls = [node for node in edge.graph.nodes if node.op == "call_function"]
        targets = {str(getattr(node.target, "_op", node.target)) for node in calls}
        assert len(decompositions) == runs
        assert ("aten.linear.default" in targets) == kept, targets
        assert "aten.add_.Tensor" not in targets and "aten.layer_norm.default" not in targets, targets
        torch.testing.assert_close(edge.module()(x), expected, rtol=0, atol=1e-6)


def test_portable_backend_delegates_nothing_and_matches():
    model = build("tiny-llama")
    result = ExecutorchExporter().run(
        model, sample_inputs(model), ExecutorchConfig(backend="portable", dynamic=True, verify=True)
    )
    assert result.record("delegate").counts["delegated_nodes"] == 0
    assert result.record("to_executorch").max_abs_diff <= 1e-4


@pytest.mark.slow  # 54 s: make test-all
def test_memory_planning_flags_reach_the_program():
    model = build("tiny-llama")
    config = ExecutorchConfig(dynamic=True, alloc_graph_input=False, alloc_graph_output=False)
    program = ExecutorchExporter().export(model, sample_inputs(model), config)
    meta = ExecutorchRunner(program).method.metadata
    assert not meta.input_tensor_meta(0).is_memory_planned()
    assert not meta.output_tensor_meta(0).is_memory_planned()
    default = ExecutorchExporter().export(model, sample_inputs(model), ExecutorchConfig(dynamic=True))
    assert ExecutorchRunner(default).method.metadata.input_tensor_meta(0).is_memory_planned()


def test_auto_classes_pick_executorch():
    config = AutoExportConfig.from_dict({"export_format": "executorch", "dynamic": True, "max_seq_len": 128})
    assert isinstance(config, ExecutorchConfig) and config.backend == "xnnpack" and config.max_seq_len == 128
    assert isinstance(AutoHfExporter.from_config(config), ExecutorchExporter)


def test_runner_feeds_inputs_by_name_whatever_the_dict_order(tmp_path):
    model = build("tiny-llama")
    sample = sample_inputs(model, 2, 8)
    save_export(tmp_path, {"model": ExecutorchExporter().run(model, sample, ExecutorchConfig(dynamic=True))})
    runner = ExportFolder(tmp_path).runner()
    inputs = sample_inputs(model, 2, 8, seed=3)
    inputs["attention_mask"][0, :3] = 0  # padding, so a swapped ids / mask pair would give other numbers
    reordered = {"attention_mask": inputs["attention_mask"], "input_ids": inputs["input_ids"]}
    assert list(reordered) != list(sample)
    torch.testing.assert_close(runner.run(reordered)[0], eager(model, inputs).logits, atol=1e-4, rtol=0)
    with pytest.raises(HfExportError, match=r"missing input\(s\) \['attention_mask'\]"):
        runner.run({"input_ids": inputs["input_ids"]})
    with pytest.raises(HfExportError, match=r"unknown input\(s\) \['token_type_ids'\]"):
        runner.run({**inputs, "token_type_ids": torch.zeros_like(inputs["input_ids"])})


@pytest.mark.slow  # 30 s of lowering: make test-all (make test is near its 30 minutes)
def test_a_sample_given_as_an_expanded_view_exports_and_runs(tmp_path):
    # mask.expand(batch, -1) shares one row's memory (stride 0): the traced program kept the stride
    # and to_executorch failed ("0 in strides is not supported for ExecuTorch")
    model = build("tiny-bert")
    one = sample_inputs(model, 1, 8)
    sample = {name: value.expand(2, -1) for name, value in one.items()}
    assert sample["input_ids"].stride(0) == 0
    save_export(tmp_path, {"model": ExecutorchExporter().run(model, sample, ExecutorchConfig(dynamic=True))})
    inputs = sample_inputs(model, 3, 12, seed=4)
    got = ExportFolder(tmp_path).runner().run(inputs)[0]
    torch.testing.assert_close(got, main_output(eager(model, inputs)), atol=1e-4, rtol=0)
    assert sample["input_ids"].stride(0) == 0  # the caller's view is left as it was


def test_planned_memory_over_the_budget_names_the_bounds_to_lower():
    from hfexport import ConfigError

    model = build("tiny-llama")
    config = ExecutorchConfig(dynamic=True, max_planned_memory_mb=1)
    with pytest.raises(
        ConfigError, match=r"plans \d+ MiB of memory, over the budget of 1 MiB.*batch <= 8.*max_seq_len"
    ):
        ExecutorchExporter().export(model, sample_inputs(model), config)


def test_a_size_computed_from_input_values_without_a_bound_is_refused_by_name():
    # Qwen2-VL's image patches per token come from repeat_interleave over image_grid_thw: memory
    # planning stopped at "Cannot evaluate a finite upper bound for symbolic expression u16 (int_oo)"
    from hfexport import UnsupportedModelError

    class RepeatsRows(torch.nn.Module):
        def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return x[torch.repeat_interleave(counts)] * 2

    inputs = {"x": torch.randn(5, 3), "counts": torch.tensor([1, 2, 2])}
    with pytest.raises(UnsupportedModelError, match=r"sizes computed from its input values.*Dynamo or ONNX"):
        ExecutorchExporter().export(RepeatsRows().eval(), inputs, ExecutorchConfig(dynamic=True))


def test_a_config_without_a_length_limit_gets_the_default_sequence_bound():
    from hfexport.targets.executorch.lowering import memory_planning_bounds

    t5 = _t5()
    bounds = memory_planning_bounds(t5, ExecutorchConfig(dynamic=True))
    assert (bounds.batch, bounds.other) == (8, 1024) and "default max_seq_len" in bounds.source
    gpt2 = build("tiny-gpt2")  # n_positions 512 caps it
    assert memory_planning_bounds(gpt2, ExecutorchConfig()).other == 512


def _t5():
    from models import build_encoder_decoder

    return build_encoder_decoder("t5")[0]


def test_spec_example_with_the_real_qwen3_config_values_loads_and_runs(tmp_path, monkeypatch):
    # Qwen3-0.6B's config with only the layers and hidden sizes shrunk: max_position_embeddings 40960
    # and a 151936-token vocabulary, which planned for max_position_embeddings could not be allocated
    import transformers

    monkeypatch.chdir(tmp_path)
    config = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=40960,
        rope_theta=1000000,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    inputs = sample_inputs(model, 1, 6)  # stands in for tokenizer("Hello, world!", return_tensors="pt")

    exporter = ExecutorchExporter()
    config = ExecutorchConfig(backend="xnnpack", dynamic=True)
    result = exporter.run(model, inputs, config=config)
    et_program = result.program
    et_program.save("model.pte")

    from executorch.runtime import Runtime

    program = Runtime.get().load_program("model.pte")
    method = program.load_method("forward")
    outputs = method.execute(list(inputs.values()))
    torch.testing.assert_close(outputs[0], eager(model, inputs).logits, atol=1e-4, rtol=0)
    assert "planned_memory_mb=" in result.report  # the report shows the planned memory
    assert result.record("capture").counts == {"max_batch_size": 8, "max_seq_len": 1024}


def test_a_program_writing_its_input_in_place_lowers_without_whole_tensor_copies():
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program._program import _gen_edge_manager_for_partitioners

    from hfexport.pipeline.pass_manager import get_pass
    from hfexport.targets.executorch.lowering import partitioners, to_edge

    class CacheWrite(torch.nn.Module):
        def forward(self, cache, slots, states):
            cache.index_copy_(2, slots, states)
            return cache.sum(-1)

    cache, slots, states = torch.zeros(1, 2, 16, 4), torch.tensor([3, 4]), torch.randn(1, 2, 2, 4)
    written = cache.clone()
    expected = CacheWrite()(written, slots, states)

    def program():
        return torch.export.export(CacheWrite(), (), {"cache": cache.clone(), "slots": slots, "states": states})

    def ops(edge):
        graph = edge.exported_program().graph
        return [getattr(n.target, "_name", "") for n in graph.nodes if n.op == "call_function"]

    # ExecuTorch's own conversion (functionalized, then decomposed) leaves two copy(cache, new
    # value) per written input, which the edge pass drop_same_layout_copies removes; to_edge,
    # which functionalizes and decomposes in one re-trace, leaves none
    xnnpack = partitioners("xnnpack")
    upstream = _gen_edge_manager_for_partitioners(
        {"forward": xnnpack}, {"forward": program()}, EdgeCompileConfig(_check_ir_validity=False), None, False
    )
    assert ops(upstream).count("aten::copy") == 2
    result = get_pass("drop_same_layout_copies")(upstream)
    assert result.program is upstream and result.counts == {"rewritten": 2}
    edge = to_edge(program(), xnnpack)
    for lowered in (upstream, edge):
        assert ops(lowered).count("aten::copy") == 0 and ops(lowered).count("aten::index_put") == 1
        run = ExecutorchRunner(lowered.to_executorch()).run
        got, write_back = run({"cache": cache.clone(), "slots": slots, "states": states})[::-1]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(write_back, written, rtol=0, atol=0)


@pytest.mark.parametrize(
    "tensor", [torch.randn(1, 3, 5), torch.tensor(7), torch.randn(2, 4).bfloat16(), torch.tensor([True, False])]
)
def test_the_decoder_copies_outputs_out_of_the_program_memory_in_any_dtype(tensor):
    from hfexport.targets.executorch.runner import _copied

    copy = _copied(tensor)
    assert copy.dtype == tensor.dtype and torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()


def test_head_transposes_around_elementwise_ops_cancel_and_an_output_keeps_its_value():
    """``cancel_head_transposes``: a [batch, length, heads, dim] tensor transposed to heads first,
    through a mul by a [1, 1, length, dim] operand and an add, and transposed back, runs the ops
    untransposed (the operand transposed instead); the program output that was the transpose back
    names the new value. A chain with another user keeps its transposes."""
    from executorch.exir import to_edge

    from hfexport.targets.executorch.passes.edge import cancel_head_transposes

    class Chain(torch.nn.Module):
        def forward(self, x, c):
            t = x.transpose(1, 2)
            return (t * c + t).transpose(1, 2), x.sum()

    class Kept(torch.nn.Module):
        def forward(self, x, c):
            y = x.transpose(1, 2) * c
            return y.transpose(1, 2), y.sum()  # y in the heads-first order is used as such

    x, c = torch.randn(1, 5, 3, 8), torch.randn(1, 1, 5, 8)

    def transposes(program):
        return [n for n in program.graph.nodes if getattr(n.target, "_name", None) == "aten::permute_copy"]

    program = to_edge(torch.export.export(Chain(), (x, c))).exported_program()
    assert len(transposes(program)) == 2
    assert cancel_head_transposes(program) == 1
    program.graph_module.graph.lint()
    assert [n.args[0].meta["val"].shape for n in transposes(program)] == [torch.Size([1, 1, 5, 8])]  # c's
    names = [spec.arg.name for spec in program.graph_signature.output_specs]
    assert names == [n.name for n in program.graph.output_node().args[0]]
    for got, want in zip(program.module()(x, c), Chain()(x, c), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    program = to_edge(torch.export.export(Kept(), (x, c))).exported_program()
    assert cancel_head_transposes(program) == 0
    assert len(transposes(program)) == 2


class _TrailingUnsqueeze(torch.nn.Module):
    def forward(self, x):
        return (x[:, :, None] * 2.0).sum(-1) + x.sum(-1, keepdim=True)


def test_an_unsqueeze_over_two_dynamic_axes_stays_out_of_xnnpack(tmp_path):
    # XNNPACK's partitioner claimed it, then its lowering failed the delegate stage: "XNNPACK
    # reshape only supports 1 dynamic dimension" (pytorch/executorch#11449)
    model = _TrailingUnsqueeze()
    x = torch.randn(2, 8)
    save_export(tmp_path, {"model": ExecutorchExporter().run(model, {"x": x}, ExecutorchConfig(dynamic=True))})
    runner = ExportFolder(tmp_path).runner()
    for shape in [(2, 8), (3, 13)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(torch.as_tensor(runner.run({"x": x})[0]), model(x), atol=1e-5, rtol=0)


class _GroupMax(torch.nn.Module):
    """A router's max over the group axis of a 4-D tensor (HY-V4, MiMo-V2-Flash)."""

    def forward(self, x):
        return torch.max(x, dim=1, keepdim=True).values + x


def test_a_max_over_an_outer_axis_stays_out_of_xnnpack(tmp_path):
    # XNNPACK's max.dim config checks the rank only, and its visitor then refused the axis: "amax.default
    # only supports dim == 2 or dim == 3" failed the delegate stage
    model = _GroupMax()
    x = torch.randn(2, 4, 3, 8)
    save_export(tmp_path, {"model": ExecutorchExporter().run(model, {"x": x}, ExecutorchConfig())})
    runner = ExportFolder(tmp_path).runner()
    torch.testing.assert_close(torch.as_tensor(runner.run({"x": x})[0]), model(x), atol=1e-6, rtol=0)


class _ConformerNorm(torch.nn.Module):
    """A conformer convolution module's batch norm over [batch, channels, length]."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(6).eval()
        self.norm.running_mean.uniform_(-1, 1)
        self.norm.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.norm(x * 1.5) * 2.0


def test_a_batch_norm_over_batch_and_length_stays_out_of_xnnpack(tmp_path):
    # XNNPACK's partitioner claimed it, then decomposed it into a 1-D convolution whose reshapes took
    # one dynamic axis: "XNNPACK reshape only supports 1 dynamic dimension" failed the delegate stage
    # (Cohere ASR's and Canary's encoders)
    model = _ConformerNorm()
    x = torch.randn(2, 6, 8)
    save_export(tmp_path, {"model": ExecutorchExporter().run(model, {"x": x}, ExecutorchConfig(dynamic=True))})
    runner = ExportFolder(tmp_path).runner()
    for shape in [(2, 6, 8), (3, 6, 13)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(torch.as_tensor(runner.run({"x": x})[0]), model(x), atol=1e-5, rtol=0)


class _HeadSplitLinear(torch.nn.Module):
    """A linear over part of each attention head (MiniCPM3's rotary half of a query head), whose
    input strides hold the length: [1, heads, length, 8] with strides (64 length, 16, 64, 1)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5, 8))

    def forward(self, x):
        heads = x.view(x.shape[0], x.shape[1], 4, 16).transpose(1, 2)
        return torch.nn.functional.linear(heads[..., :8], self.weight)


def test_a_linear_over_strided_heads_keeps_the_length_dynamic(tmp_path):
    # to_edge's matmul decomposition compared the input's strides with guard_or_false, which guards
    # on a backed size: 16 == 8 * length held for the sample's 2, and the program took 2 only
    # (MiniCPM3's, HY-V4's and Phi's decode steps refused one token)
    model = _HeadSplitLinear()
    config = ExecutorchConfig(dynamic=True, max_batch_size=1)
    save_export(tmp_path, {"model": ExecutorchExporter().run(model, {"x": torch.randn(1, 2, 64)}, config)})
    runner = ExportFolder(tmp_path).runner()
    for length in (2, 7):
        x = torch.randn(1, length, 64)
        torch.testing.assert_close(torch.as_tensor(runner.run({"x": x})[0]), model(x), atol=1e-5, rtol=1e-5)


class NoneMaskFirst(torch.nn.Module):
    def forward(self, attention_mask, hidden_states):
        # a multimodal language model's mask dict holds None for a mask it builds itself
        assert attention_mask["full_attention"] is None
        return torch.clamp(hidden_states * 2.5 + 1, min=-0.5)


def test_a_none_user_input_before_the_tensors_lowers(tmp_path):
    # to_edge lifted the constants it makes from scalars before the first tensor user input and
    # their specs before the first user input spec (the None one): the verifier refused the program
    # ("Input spec name _lifted_tensor_constant2 does not match node name ..."; Ovis2's language model)
    inputs = {"attention_mask": {"full_attention": None}, "hidden_states": torch.randn(2, 3, 4)}
    result = ExecutorchExporter().run(NoneMaskFirst(), inputs, ExecutorchConfig(dynamic=True))
    save_export(tmp_path, {"model": result})
    other = {"attention_mask": {"full_attention": None}, "hidden_states": torch.randn(3, 5, 4)}
    got = ExportFolder(tmp_path).runner().run(other)[0]
    torch.testing.assert_close(got, NoneMaskFirst()(**other))


EDGE_PASSES = [
    "drop_same_layout_copies",
    "drop_same_shape_expands",
    "infer_the_dynamic_view_axis",
    "state_in_attention_layout",
    "custom_sdpa_reads_causally",
    "merge_repeated_index_arithmetic",
    "drop_same_shape_views",
    "cancel_head_transposes",
    "drop_contiguous_clones",
]


def test_the_edge_rewrites_are_passes_listed_in_their_stage(capsys):
    from hfexport.cli import main

    assert main(["passes", "--format", "executorch"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        "executorch: capture → fx_passes → to_edge → program_state → edge_passes → delegate → to_executorch"
    )
    listed = out.split("edge_passes:\n")[1].split("\ndelegate")[0].splitlines()
    assert [line.split()[1] for line in listed] == EDGE_PASSES


@pytest.mark.slow  # three ExecuTorch exports, about 2 minutes: make test-all (make test's 30 minutes)
def test_an_edge_pass_is_dumped_timed_removable_and_verified(tmp_path):
    from executorch.exir.dialects._ops import ops as exir_ops

    from hfexport import Pass, PassResult, VerificationError
    from hfexport.targets import get_target

    model = build("tiny-llama")
    inputs = sample_inputs(model, 1, 8)  # one sequence: the attention runs on the fused kernel
    config = ExecutorchConfig(dynamic=True, max_batch_size=1, verify=True, dump_dir=str(tmp_path))
    default = ExecutorchExporter().run(model, inputs, config)
    stage = default.record("edge_passes")
    assert [child.name for child in stage.children] == EDGE_PASSES
    chains = default.record("edge_passes/cancel_head_transposes").counts["rewritten"]
    assert chains >= 4  # the query's and key's rotary in each of the two layers
    for index, name in enumerate(EDGE_PASSES):
        folder = tmp_path / "04_edge_passes" / f"{index:02d}_{name}"
        assert (folder / "graph.txt").is_file() and "nodes" in (folder / "stats.json").read_text(), name
        assert default.record(f"edge_passes/{name}").seconds is not None
    assert "| ↳ cancel_head_transposes |" in default.report

    # without it the edge program keeps the rotary's transposes, and still matches eager
    passes = [p for p in get_target("executorch").default_passes if p != "cancel_head_transposes"]
    config = ExecutorchConfig(dynamic=True, max_batch_size=1, verify=True, passes=passes)
    kept = ExecutorchExporter().run(model, inputs, config)
    assert [child.name for child in kept.record("edge_passes").children] == [
        p for p in EDGE_PASSES if p != "cancel_head_transposes"
    ]
    assert kept.record("edge_passes").nodes_out > stage.nodes_out  # a transpose each way per chain
    assert kept.record("to_executorch").max_abs_diff <= 1e-4

    class AddsBecomeSubs(Pass):
        name = "edge_adds_become_subs"
        stage = "edge_passes"

        def __call__(self, edge):
            changed = 0
            for node in edge.exported_program().graph.nodes:
                if node.target == exir_ops.edge.aten.add.Tensor:
                    node.target = exir_ops.edge.aten.sub.Tensor
                    changed += 1
            edge.exported_program().graph_module.recompile()
            return PassResult(edge, modified=bool(changed), counts={"rewritten": changed})

    passes = [*get_target("executorch").default_passes]
    passes.insert(passes.index("drop_same_shape_views"), AddsBecomeSubs())
    config = ExecutorchConfig(dynamic=True, max_batch_size=1, verify="passes", passes=passes)
    with pytest.raises(VerificationError, match=r"pass 'edge_adds_become_subs' \(stage 'edge_passes'\)"):
        ExecutorchExporter().run(model, inputs, config)


@register_pass(name="explode_on_edge_test", stage="edge_passes")
def _explode_on_edge(edge):
    """Fails on purpose, naming what it read of the edge program (test)."""
    program = edge.exported_program()
    state = sorted(name for name in program.state_dict if name.startswith("state."))
    raise RuntimeError(f"boom on {len(program.graph.nodes)} nodes, state {state}")


def test_a_failing_edge_pass_replays_with_the_command_its_reproducer_prints(tmp_path, capsys):
    import shlex

    from hfexport import PassError, run_for_generation
    from hfexport.cli import main
    from hfexport.pipeline.pass_manager import PassManager
    from hfexport.targets import get_target

    model = build("tiny-llama")
    passes = [*get_target("executorch").default_passes]
    passes.insert(passes.index("state_in_attention_layout") + 1, "explode_on_edge_test")
    config = ExecutorchConfig(dump_dir=str(tmp_path / "dump"), passes=passes)
    from transformers import GenerationConfig

    generation = GenerationConfig(cache_implementation="static", max_cache_len=32)
    with pytest.raises(PassError) as in_pipeline:
        run_for_generation(model, sample_inputs(model, 1, 6), [config], generation, components=["decode"])
    error = in_pipeline.value.__cause__  # the component's PassError ("component 'decode': …" wraps it)
    assert error.pass_name == "explode_on_edge_test" and error.passes_before[-1] == "state_in_attention_layout"
    assert "state ['state.cache.layers.0.keys'" in error.cause  # the input kept the program's state
    folder = tmp_path / "dump" / "decode" / "04_edge_passes" / "04_explode_on_edge_test"
    command = (folder / "repro.txt").read_text().splitlines()[-1]
    repro = shlex.split(command)
    assert repro[:5] == ["hfexport", "replay", "--import", __file__, str(folder / "input.edge.pt2")]
    assert not list((tmp_path / "dump" / "decode").glob("0[2-4]_*/program*"))  # no edge program per stage

    capsys.readouterr()
    assert main(repro[1:]) == 2
    assert capsys.readouterr().err.splitlines()[0].endswith(str(error).splitlines()[0])
    with pytest.raises(PassError) as replayed:
        program = get_target("executorch").load_program(folder / "input.edge.pt2")
        PassManager(["explode_on_edge_test"]).run(program, error.passes_before)
    assert (replayed.value.pass_name, replayed.value.passes_before) == (error.pass_name, error.passes_before)
    assert replayed.value.cause.split(" nodes")[1] == error.cause.split(" nodes")[1]  # the same state

    # a pass that works writes an edge program replay reads again
    out = tmp_path / "views.edge.pt2"
    assert main(["replay", str(folder / "input.edge.pt2"), "--passes", "drop_same_shape_views", "--out", str(out)]) == 0
    assert "drop_same_shape_views: modified=True" in capsys.readouterr().err
    assert get_target("executorch").load_program(out).exported_program().graph_signature.user_inputs


def test_the_llm_runner_program_s_attention_reads_the_cache_in_place(tmp_path):
    # the runner's masks are causal from input_pos[0]: custom_sdpa takes the whole state cache, that
    # slot and is_causal (it views the filled keys itself) instead of a copy of the filled keys
    from transformers import GenerationConfig

    from hfexport.exporters import run_for_generation

    model = build("tiny-llama")
    cache = GenerationConfig(cache_implementation="static", max_cache_len=32)
    config = ExecutorchConfig(dynamic=True, llm_runner=True, verify=True)  # each stage checked against eager
    result = run_for_generation(model, sample_inputs(model, 1, 6), [config], cache, multi_token_decode=True)
    result = result["decode"][config.export_format]
    assert result.record("edge_passes/custom_sdpa_reads_causally").counts == {"rewritten": 2}
    # the second layer's cache-write slots (arange, add) are the first's
    assert result.record("edge_passes/merge_repeated_index_arithmetic").counts == {"rewritten": 2}
    graph = result.program.exported_program().graph
    attention = [n for n in graph.nodes if "custom_sdpa" in str(n.target)]
    assert len(attention) == 2 and all(n.args[4] is None and n.args[6] is True for n in attention)
    assert not [n for n in graph.nodes if "slice_copy" in str(n.target) and n.meta["val"].dim() == 4]
