"""grouped_mm_to_batched_mm: op counts before / after and numerics, on aten._grouped_mm and on
transformers' grouped_mm_fallback op, and on a tiny Qwen3-MoE."""

import pytest
import torch
from graphs import count
from models import build, eager, sample_inputs

from hfexport import DynamoConfig, DynamoExporter, get_pass

aten = torch.ops.aten


class GroupedMM(torch.nn.Module):
    dtype = torch.bfloat16  # torch's grouped_mm only traces in bf16 (its meta kernel checks)

    def __init__(self, experts=3, k=16, n=8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, k, n, dtype=self.dtype))

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.weight, offs=offs)


class TransformersFallback(GroupedMM):
    dtype = torch.float32

    def forward(self, x, offs):
        import transformers.integrations.moe  # noqa: F401  (registers the op)

        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, offs=offs)


def reference(x, weight, offs):
    out, start = torch.zeros(x.shape[0], weight.shape[2], dtype=x.dtype), 0
    for expert, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ weight[expert]
        start = end
    return out


@pytest.mark.parametrize("module_class", [GroupedMM, TransformersFallback])
def test_rewrite_counts_and_numerics(module_class):
    torch.manual_seed(0)
    module = module_class()
    x, offs = torch.randn(6, 16, dtype=module.dtype), torch.tensor([2, 2, 6], dtype=torch.int32)
    rows = torch.export.Dim("rows", min=1, max=64)
    program = torch.export.export(module, (x, offs), dynamic_shapes=({0: rows}, None))
    target = next(n.target for n in program.graph.nodes if "grouped_mm" in str(n.target))
    assert count(program, target) == 1 and count(program, aten.bmm.default) == 0

    result = get_pass("grouped_mm_to_batched_mm")(program)
    assert result.counts == {"rewritten": 1, "missed": 0}
    assert count(result.program, target) == 0 and count(result.program, aten.bmm.default) == 1
    for rows_, offs_ in [(6, [2, 2, 6]), (9, [0, 5, 7])]:  # a last group end below the row count too
        x = torch.randn(rows_, 16, dtype=module.dtype)
        offs_ = torch.tensor(offs_, dtype=torch.int32)
        expected = reference(x, module.weight.detach(), offs_)
        torch.testing.assert_close(result.program.module()(x, offs_), expected, atol=2e-2, rtol=1e-2)


class BatchedGroupedMM(GroupedMM):
    def forward(self, x):
        return torch._grouped_mm(x, self.weight)  # 3-D by 3-D without offs: not the MoE layout


def test_grouped_mm_without_offs_is_missed_with_a_warning(hfexport_logs):
    module = BatchedGroupedMM()
    program = torch.export.export(module, (torch.randn(3, 4, 16, dtype=module.dtype),))
    result = get_pass("grouped_mm_to_batched_mm")(program)
    assert result.counts == {"rewritten": 0, "missed": 1} and not result.modified
    assert count(result.program, aten._grouped_mm.default) == 1
    row = "| _grouped_mm | aten._grouped_mm.default | grouped_mm_as_gather_bmm | missed: no offs |"
    assert row in result.files["rewrites.md"]
    assert [r.getMessage() for r in hfexport_logs.records] == ["grouped_mm_to_batched_mm: left _grouped_mm (no offs)"]


def test_qwen3_moe_matches_eager_after_rewrite():
    model = build("tiny-qwen3-moe")
    config = DynamoConfig(dynamic=True, verify=True, passes="grouped_mm_to_batched_mm,dead_code_elimination")
    result = DynamoExporter().run(model, sample_inputs(model), config)
    assert result.record("grouped_mm_to_batched_mm").counts["rewritten"] == model.config.num_hidden_layers * 2
    assert not any("grouped_mm" in str(n.target) for n in result.program.graph.nodes)
    inputs = sample_inputs(model, 3, 13, seed=2)
    with torch.no_grad():
        got = result.program.module()(**inputs).logits
    torch.testing.assert_close(got, eager(model, inputs).logits, atol=1e-4, rtol=0)
