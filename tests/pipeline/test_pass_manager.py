"""Pass lists: composition, ordering constraints, failures, dumps."""

import re

import pytest
import torch
from models import build, sample_inputs

from hfexport import (
    DynamoConfig,
    DynamoExporter,
    Pass,
    PassError,
    PassManager,
    PassOrderError,
    PassResult,
    register_pass,
)


class CountAdds(Pass):
    """A user-written pass that only inspects the graph."""

    name = "count_adds"
    description = "count aten.add nodes"

    def __call__(self, program):
        adds = sum(1 for n in program.graph.nodes if n.target is torch.ops.aten.add.Tensor)
        return PassResult(program, modified=False, counts={"adds": adds})


class Explode(Pass):
    name = "explode"

    def __call__(self, program):
        # half-rewrite the graph, then fail: the dumped input must be the untouched program
        next(n for n in program.graph.nodes if n.op == "call_function").meta["touched"] = True
        raise RuntimeError("boom")


def test_compose_pass_list_in_code_and_find_it_in_dumps(tmp_path):
    model = build("tiny-llama")
    config = DynamoConfig(dynamic=True, dump_dir=str(tmp_path))
    pipeline = DynamoExporter().build_pipeline(config)
    assert pipeline.passes.names == list(DynamoExporter().target.default_passes)
    pipeline.passes.insert("dead_code_elimination", CountAdds())
    pipeline.passes.remove("remove_noop_conversions")
    result = pipeline.run(model, sample_inputs(model))

    names = [r.name for r in result.record("fx_passes").children]
    expected = [p for p in DynamoExporter().target.default_passes if p != "remove_noop_conversions"]
    expected.insert(expected.index("dead_code_elimination"), "count_adds")
    assert names == expected and "count_adds" in names
    assert result.record("count_adds").counts["adds"] > 0
    folder = tmp_path / "01_fx_passes" / f"{names.index('count_adds'):02d}_count_adds"
    assert (folder / "graph.txt").read_text().strip()
    assert '"nodes"' in (folder / "stats.json").read_text()
    report = (tmp_path / "report.md").read_text()
    assert re.search(r"\| ↳ count_adds \| [0-9.]+ \|", report)
    assert "remove_noop_conversions" not in (tmp_path / "pipeline.txt").read_text()
    # the removed pass really did not run: its no-op conversions are still in the graph
    assert any(n.target is torch.ops.aten.to.dtype for n in result.program.graph.nodes)


def test_pass_list_from_string_and_registered_function():
    @register_pass(name="tag_nothing_test")
    def tag_nothing(program):
        """Does nothing (test)."""
        return PassResult(program, modified=False)

    model = build("tiny-llama")
    result = DynamoExporter().run(
        model, sample_inputs(model), DynamoConfig(passes="tag_nothing_test, dead_code_elimination")
    )
    assert [r.name for r in result.record("fx_passes").children] == ["tag_nothing_test", "dead_code_elimination"]


def test_constraint_violation_is_rejected_naming_both_passes():
    manager = PassManager(["dead_code_elimination", "remove_tensor_metadata_asserts"])
    with pytest.raises(
        PassOrderError, match="'remove_tensor_metadata_asserts' must run before pass 'dead_code_elimination'"
    ):
        manager.check()
    model = build("tiny-llama")
    with pytest.raises(PassOrderError):
        DynamoExporter().export(
            model, sample_inputs(model), DynamoConfig(passes="dead_code_elimination,remove_noop_conversions")
        )


def test_constraint_cycle_is_rejected():
    class A(Pass):
        name = "cycle_a"
        runs_after = ("cycle_b",)

    class B(Pass):
        name = "cycle_b"
        runs_after = ("cycle_a",)

    with pytest.raises(PassOrderError, match="cycle"):
        PassManager([A(), B()]).check()


def test_unknown_pass_name_lists_the_registered_ones():
    config = DynamoConfig(passes="nope")  # a config is data; names are resolved by the pipeline
    with pytest.raises(ValueError, match="unknown pass 'nope'; registered passes: .*dead_code_elimination"):
        DynamoExporter().build_pipeline(config)


def test_raising_pass_is_named_with_the_passes_before_it_and_leaves_a_reproducer(tmp_path):
    model = build("tiny-llama")
    config = DynamoConfig(dump_dir=str(tmp_path), passes=["remove_tensor_metadata_asserts", Explode()])
    with pytest.raises(PassError) as caught:
        DynamoExporter().export(model, sample_inputs(model), config)
    message = str(caught.value)
    assert "'explode'" in message and "boom" in message
    assert "passes before it: remove_tensor_metadata_asserts" in message
    folder = tmp_path / "01_fx_passes" / "01_explode"
    assert (folder / "repro.txt").read_text().startswith("hfexport replay")
    dumped = torch.export.load(folder / "input.pt2")
    assert not any(n.meta.get("touched") for n in dumped.graph.nodes)
    assert "explode" in (tmp_path / "report.md").read_text() and "boom" in (tmp_path / "report.md").read_text()


def test_pass_that_breaks_the_signature_is_rejected():
    class DropOutput(Pass):
        name = "drop_output"

        def __call__(self, program):
            output = next(n for n in program.graph.nodes if n.op == "output")
            output.args = (output.args[0][:1],)
            return PassResult(program, modified=True)

    model = build("tiny-llama")
    with pytest.raises(PassError, match="drop_output.*signature"):
        DynamoExporter().export(model, sample_inputs(model), DynamoConfig(passes=[DropOutput()]))


@register_pass(name="explode_registered_test")
def _explode_registered(program):
    """Fails on purpose (test)."""
    raise RuntimeError("boom in a registered pass")


def test_replay_raises_the_same_pass_error_as_the_pipeline(tmp_path, capsys):
    import shlex

    from hfexport.cli import main
    from hfexport.pipeline.pass_manager import PassManager
    from hfexport.targets.dynamo import load_exported_program

    model = build("tiny-llama")
    passes = "remove_tensor_metadata_asserts,remove_noop_conversions,explode_registered_test"
    with pytest.raises(PassError) as in_pipeline:
        DynamoExporter().export(model, sample_inputs(model), DynamoConfig(dump_dir=str(tmp_path), passes=passes))
    error = in_pipeline.value
    assert error.pass_name == "explode_registered_test"
    assert error.passes_before == ("remove_tensor_metadata_asserts", "remove_noop_conversions")
    folder = tmp_path / "01_fx_passes" / "02_explode_registered_test"
    assert any(str(folder / "input.pt2") in note for note in error.__notes__)  # where its input is dumped

    # the reproducer, from Python and from the command line, fails with the same error
    comment, command = (folder / "repro.txt").read_text().splitlines()
    assert comment.startswith("# 'explode_registered_test' is not one of hfexport's passes: --import loads")
    repro = shlex.split(command)
    assert repro[:5] == ["hfexport", "replay", "--import", __file__, str(folder / "input.pt2")]
    applied = repro[repro.index("--applied") + 1].split(",")
    with pytest.raises(PassError) as replayed:
        PassManager(["explode_registered_test"]).run(load_exported_program(folder / "input.pt2"), applied)
    assert str(replayed.value) == str(error)
    assert (replayed.value.pass_name, replayed.value.passes_before, replayed.value.cause) == (
        error.pass_name,
        error.passes_before,
        error.cause,
    )
    assert main(repro[1:]) == 2
    assert f"hfexport: error: {error}" in capsys.readouterr().err


class ReturnsAString(Pass):
    name = "returns_a_string"

    def __call__(self, program):
        return PassResult("not a program", modified=True)


def test_pass_returning_a_non_program_is_named():
    from hfexport.pipeline.pass_manager import execute_pass

    model = build("tiny-llama")
    with pytest.raises(PassError, match="pass 'returns_a_string' failed.*program is a str, expected ExportedProgram"):
        DynamoExporter().export(model, sample_inputs(model), DynamoConfig(passes=[ReturnsAString()]))
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    with pytest.raises(PassError, match="returns_a_string.*passes before it: a, b"):
        execute_pass(ReturnsAString(), program, ["a", "b"])


def test_a_program_copies_the_weights_a_user_holds_and_shares_those_only_hfexport_holds():
    # the copy doubled an export's peak memory; a model hfexport converted (or the command line
    # loaded) is no one else's, so its programs share its tensors until a user's pass runs
    from hfexport.pipeline.pass_manager import own_weights
    from hfexport.precision import converted_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def pointers(program):
        return {t.data_ptr() for t in program.state_dict.values()}

    users = {t.data_ptr() for t in model.state_dict().values()}
    program = torch.export.export(model, (torch.ones(3, 4),))
    assert pointers(program) <= users  # torch.export holds the model's own tensors
    assert not pointers(own_weights(program)) & users
    converted = converted_model(model, torch.bfloat16)
    privates = {t.data_ptr() for t in converted.state_dict().values()}
    program = torch.export.export(converted, (torch.ones(3, 4, dtype=torch.bfloat16),))
    assert pointers(own_weights(program)) <= privates  # shared
    assert not pointers(own_weights(program, everything=True)) & privates  # before a user's pass
