"""Instruments: numerics check names the first bad stage; report and timings; dumps."""

import json

import pytest
import torch
from models import build, sample_inputs

from hfexport import DynamoConfig, DynamoExporter, Pass, PassResult, VerificationError


class AddsBecomeSubs(Pass):
    """A wrong rewrite: the numerics check must catch it."""

    name = "adds_become_subs"

    def __call__(self, program):
        changed = 0
        for node in program.graph.nodes:
            if node.target is torch.ops.aten.add.Tensor:
                node.target = torch.ops.aten.sub.Tensor
                changed += 1
        program.graph_module.recompile()
        return PassResult(program, modified=bool(changed), counts={"rewritten": changed})


def test_verify_names_the_first_stage_over_tolerance(tmp_path):
    model = build("tiny-llama")
    config = DynamoConfig(dynamic=True, verify=True, dump_dir=str(tmp_path), passes=[AddsBecomeSubs()])
    with pytest.raises(VerificationError, match=r"stage 'fx_passes'.*max abs [0-9.e+-]+ \(tolerance 0.0001\)"):
        DynamoExporter().export(model, sample_inputs(model), config)
    report = (tmp_path / "report.md").read_text()
    assert "| capture |" in report and "0.00e+00" in report  # capture itself matched eager
    assert "VerificationError" in report


def test_a_failed_numerics_check_goes_through_the_error_path(tmp_path):
    # the check used to raise inside the instruments' `after` loop: no FAILED line, no error.txt
    import io

    from hfexport.pipeline.instruments import ProgressInstrument

    model = build("tiny-llama")
    config = DynamoConfig(dynamic=True, verify=True, dump_dir=str(tmp_path), passes=[AddsBecomeSubs()])
    progress = io.StringIO()
    with pytest.raises(VerificationError):
        DynamoExporter().run(model, sample_inputs(model), config, [ProgressInstrument(progress)])
    lines = progress.getvalue().splitlines()
    assert lines[-1] == "[2/2] fx_passes FAILED" and not any("fx_passes done" in line for line in lines)
    error = (tmp_path / "01_fx_passes" / "error.txt").read_text()
    assert error.startswith("VerificationError: stage 'fx_passes': outputs differ from eager")
    assert "aten.sub.Tensor" in (tmp_path / "01_fx_passes" / "graph.txt").read_text()  # the failing output


def test_a_stage_whose_program_cannot_run_is_reported_not_checked(tmp_path):
    from hfexport.pipeline.pipeline import Pipeline, TransformStage

    class Opaque:  # a program kind with no runner registered
        pass

    model = build("tiny-llama")
    config = DynamoConfig(dynamic=True, verify=True)
    stages = [TransformStage("to_opaque", lambda program, run: Opaque())]
    pipeline = Pipeline.for_config(stages, config)
    result = pipeline.run(model, sample_inputs(model))
    assert result.record("capture").checked is True and result.record("capture").max_abs_diff == 0
    assert result.record("to_opaque").checked is False and result.record("to_opaque").max_abs_diff is None
    assert "| to_opaque |" in result.report and "| not checked |" in result.report


def test_records_and_report_without_dumps():
    model = build("tiny-gpt2")
    result = DynamoExporter().run(model, sample_inputs(model), DynamoConfig(dynamic=True, verify=True))
    capture = result.record("capture")
    assert capture.seconds > 0 and capture.peak_rss_mb > 0 and capture.nodes_out > 0
    assert capture.max_abs_diff is not None and capture.max_abs_diff <= 1e-4
    passes = result.record("fx_passes")
    assert passes.nodes_in == capture.nodes_out and passes.nodes_out < passes.nodes_in
    assert "| fx_passes |" in result.report


def test_dump_layout(tmp_path):
    model = build("tiny-bert")
    DynamoExporter().export(model, sample_inputs(model), DynamoConfig(dynamic=True, dump_dir=tmp_path))
    assert (tmp_path / "00_capture" / "program.pt2").is_file()
    assert (tmp_path / "01_fx_passes" / "program.pt2").is_file()
    stats = json.loads((tmp_path / "01_fx_passes" / "00_remove_tensor_metadata_asserts" / "stats.json").read_text())
    assert stats["nodes"] == sum(stats["op_histogram"].values())
    assert "aten._assert_tensor_metadata.default" not in stats["op_histogram"]
    assert (tmp_path / "pipeline.txt").read_text().startswith("capture | fx_passes(")
    loaded = torch.export.load(tmp_path / "01_fx_passes" / "program.pt2")
    inputs = sample_inputs(model, 3, 11)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.module()(**inputs).last_hidden_state, model(**inputs).last_hidden_state, atol=1e-4, rtol=0
        )


def test_dumps_keep_inputs_named_after_builtins(tmp_path):
    # nn.Linear's forward takes `input`; copying a graph renames such nodes (`input_1`)
    layer = torch.nn.Linear(8, 4)
    config = DynamoConfig(dynamic=True, verify=True, dump_dir=tmp_path)
    program = DynamoExporter().export(layer, {"input": torch.randn(2, 8)}, config)
    assert list(program.graph_signature.user_inputs) == ["input"]
    assert (tmp_path / "01_fx_passes" / "00_remove_tensor_metadata_asserts" / "graph.txt").is_file()


def test_verify_passes_names_the_pass_that_changed_the_numerics():
    model = build("tiny-llama")
    config = DynamoConfig(dynamic=True, verify="passes")
    pipeline = DynamoExporter().build_pipeline(config)
    pipeline.passes.insert("dead_code_elimination", AddsBecomeSubs())
    with pytest.raises(VerificationError, match=r"pass 'adds_become_subs' \(stage 'fx_passes'\).*first pass over"):
        pipeline.run(model, sample_inputs(model))
    # the passes before it were checked and matched
    result = DynamoExporter().run(model, sample_inputs(model), config)
    diffs = [child.max_abs_diff for child in result.record("fx_passes").children]
    assert diffs and all(d is not None and d <= 1e-4 for d in diffs)


def test_verify_takes_true_false_or_passes():
    from hfexport import ConfigError

    with pytest.raises(ConfigError, match="verify must be True, False or 'passes'"):
        DynamoConfig(verify="stages!")
