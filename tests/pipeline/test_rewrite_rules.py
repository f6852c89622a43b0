"""Rewrite rules: pattern / check / rewrite, counts, the rewrites.md table, registration."""

import pytest
import torch
from graphs import count

from hfexport.pipeline import pass_manager
from hfexport.pipeline.graph_edit import GraphEditor
from hfexport.pipeline.rewrite_rules import RewriteRule, RulePass, rule_pass

aten = torch.ops.aten


class Scales(torch.nn.Module):
    def forward(self, x):
        return x * 2 + x * 3


def doubles_only(node):
    factor = node.args[1]
    return None if factor == 2 else f"factor is {factor}, not 2"


def mul_by_two_as_add(graph, node):
    edit = GraphEditor(graph, node)
    node.replace_all_uses_with(edit.call(aten.add.Tensor, node.args[0], node.args[0]))
    graph.erase_node(node)


DOUBLE = RewriteRule("double_as_add", {aten.mul.Tensor}, doubles_only, mul_by_two_as_add)


def test_rule_rewrites_one_node_and_misses_the_other_with_its_reason(hfexport_logs):
    x = torch.randn(4, 3)
    program = torch.export.export(Scales(), (x,))
    assert count(program, aten.mul.Tensor) == 2 and count(program, aten.add.Tensor) == 1

    result = RulePass("toy_doubles", [DOUBLE])(program)
    assert result.modified and result.counts == {"rewritten": 1, "missed": 1}
    assert count(result.program, aten.mul.Tensor) == 1 and count(result.program, aten.add.Tensor) == 2
    assert result.files["rewrites.md"] == (
        "# toy_doubles: 1 rewritten, 1 missed\n"
        "\n"
        "| node | target | rule | result |\n"
        "| --- | --- | --- | --- |\n"
        "| mul | aten.mul.Tensor | double_as_add | rewritten |\n"
        "| mul_1 | aten.mul.Tensor | double_as_add | missed: factor is 3, not 2 |\n"
    )
    added = next(n for n in result.program.graph.nodes if n.target is aten.add.Tensor and n.args[0] is n.args[1])
    assert added.meta["val"].shape == (4, 3)
    torch.testing.assert_close(result.program.module()(x), Scales()(x))
    assert not hfexport_logs.records  # misses only warn when the rule asks to


def test_predicate_pattern_warned_miss_and_no_match(hfexport_logs):
    program = torch.export.export(Scales(), (torch.randn(2),))
    refuse = RewriteRule(
        "refuse",
        lambda n: n.target is aten.add.Tensor,
        lambda n: "not | supported",
        lambda g, n: None,
        warn_on_miss=True,
    )
    result = RulePass("toy_refuse", [refuse])(program)
    assert not result.modified and result.counts == {"rewritten": 0, "missed": 1}
    assert "| add | aten.add.Tensor | refuse | missed: not \\| supported |" in result.files["rewrites.md"]
    assert [r.getMessage() for r in hfexport_logs.records] == ["toy_refuse: left add (not | supported)"]

    result = RulePass("toy_none", [RewriteRule("never", {aten.bmm.default}, doubles_only, mul_by_two_as_add)])(program)
    assert not result.modified and result.counts == {"rewritten": 0, "missed": 0}
    assert result.files["rewrites.md"] == "# toy_none: 0 rewritten, 0 missed\n\nNo node matched the rules (never).\n"


def test_rule_pass_registers_with_ordering_and_description(monkeypatch):
    monkeypatch.setattr(pass_manager, "_REGISTRY", dict(pass_manager._REGISTRY))
    registered = rule_pass(
        "toy_registered",
        [DOUBLE],
        runs_before=("dead_code_elimination",),
        description="""Rewrite x * 2
        as x + x.

        Details.
        """,
    )
    assert pass_manager.get_pass("toy_registered") is registered
    assert registered.runs_before == ("dead_code_elimination",) and registered.stage == "fx_passes"
    assert registered.description == "Rewrite x * 2 as x + x."
    assert registered.__doc__.endswith("Details.")


def test_a_bare_target_is_not_a_pattern():
    with pytest.raises(TypeError, match="collection of targets"):
        RewriteRule("bare", aten.mul.Tensor, doubles_only, mul_by_two_as_add)


def test_replacing_a_size_the_program_returns_names_the_replacement_in_the_signature():
    # Moshi returns a size as an output; the ONNX lowering reads every size off the inputs
    # (replace_node), which left the signature naming the erased node: torch.onnx's KeyError
    from torch.export.graph_signature import SymIntArgument

    from hfexport.pipeline.graph_edit import GraphEditor, replace_node

    class ReturnsASize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            y = x.transpose(0, 1)
            return y * 2, y.shape[0]

    program = torch.export.export(
        ReturnsASize(), (torch.randn(3, 4),), dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    )
    (size,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.sym_size.int and n.args[1] == 1]
    placeholder = next(n for n in program.graph.nodes if n.op == "placeholder")
    first = next(n for n in program.graph.nodes if n.op != "placeholder")
    read = GraphEditor(program.graph, first).call(torch.ops.aten.sym_size.int, placeholder, 1)
    read.meta["val"] = size.meta["val"]
    replace_node(program, size, read)
    returned = [spec.arg for spec in program.graph_signature.output_specs if isinstance(spec.arg, SymIntArgument)]
    assert [arg.name for arg in returned] == [read.name]
    program.graph_module.recompile()
    assert program.module()(torch.randn(5, 6))[1] == 6
