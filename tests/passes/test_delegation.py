"""Rewrites for the XNNPACK delegate: RMSNorm's mean as a linear layer."""

import torch
from graphs import count
from models import build, eager, sample_inputs

from hfexport import DynamoConfig, DynamoExporter, ExecutorchConfig, ExecutorchExporter, get_pass

aten = torch.ops.aten


class Norms(torch.nn.Module):
    def forward(self, x):
        return x.pow(2).mean(-1, keepdim=True), x.mean(dim=[2], keepdim=True), x.mean(-1), x.mean(1, keepdim=True)


def test_only_keepdim_means_over_a_static_last_axis_are_rewritten():
    x = torch.randn(2, 5, 8)
    program = torch.export.export(Norms(), (x,), dynamic_shapes=({0: torch.export.Dim("b"), 1: torch.export.Dim("s")},))
    result = get_pass("last_axis_mean_as_linear")(program)
    # the first two are over the last axis with keepdim; mean(-1) drops the axis, mean(1) is another axis
    assert result.counts == {"rewritten": 2}
    assert count(result.program, aten.mean.dim) == 2 and count(result.program, aten.linear.default) == 2
    x = torch.randn(3, 7, 8)
    for got, expected in zip(result.program.module()(x), Norms()(x), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_rms_norms_go_to_xnnpack_and_the_model_still_matches_eager():
    model = build("tiny-llama")
    inputs = sample_inputs(model)
    program = DynamoExporter().export(
        model, inputs, DynamoConfig(passes=[*DynamoExporter().target.default_passes, "last_axis_mean_as_linear"])
    )
    assert count(program, aten.mean.dim) == 0  # 2 layers x 2 norms + the final norm, all rewritten
    result = ExecutorchExporter().run(model, inputs, ExecutorchConfig())
    (delegate,) = [r for r in result.records if r.name == "delegate"]
    assert "aten_mean_dim" not in delegate.files["delegation.md"]
    from hfexport.targets.executorch.lowering import run_pte

    torch.testing.assert_close(
        torch.as_tensor(run_pte(result.program, inputs)[0]), eager(model, inputs).logits, atol=1e-4, rtol=1e-4
    )
