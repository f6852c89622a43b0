"""Pattern / check / rewrite rules for FX graph passes, in the style of onnxscript's rewrite rules.

A :class:`RewriteRule` names the nodes it looks at (its ``pattern``), says for each of them
whether it applies (``check`` returns ``None``) or why not (a short reason), and replaces the
node (``rewrite``, usually through :class:`~hfexport.pipeline.graph_edit.GraphEditor`).
:func:`rule_pass` turns a list of rules into a registered pass whose counts say how many nodes
were rewritten and how many were missed, and whose ``rewrites.md`` lists every matched node with
its outcome.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node

from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass

logger = logging.getLogger("hfexport")


@dataclass(frozen=True)
class RewriteRule:
    """One rewrite: which nodes it looks at, when it applies, and how it replaces a node.

    ``pattern`` is a collection of ``call_function`` targets (``{aten.bmm.default}``) or a
    predicate ``match(node) -> bool``. ``check(node)`` returns ``None`` when the rule applies to a
    matched node, else a short human reason why not (``"out_dtype set"``). ``rewrite(graph,
    node)`` replaces ``node``; it may erase ``node`` but no other node the rule could match.
    ``warn_on_miss`` logs a warning for each refused node, for rules whose miss leaves an op the
    target cannot run.
    """

    name: str
    pattern: Collection[Any] | Callable[[Node], bool]
    check: Callable[[Node], str | None]
    rewrite: Callable[[Graph, Node], None]
    warn_on_miss: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.pattern, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            raise TypeError(f"rule {self.name!r}: pattern must be a collection of targets, e.g. {{{self.pattern}}}")

    def matches(self, node: Node) -> bool:
        """Whether ``node`` is one the rule looks at."""
        if isinstance(self.pattern, Collection):
            return node.op == "call_function" and node.target in self.pattern
        return self.pattern(node)


@dataclass(frozen=True)
class Outcome:
    """What one rule did to one matched node: ``reason`` is ``None`` when it was rewritten."""

    node: str
    target: str
    rule: str
    reason: str | None


class RulePass(Pass):
    """An in-place pass over an ``ExportedProgram``'s graph that applies ``rules`` in order, each
    in one walk over the nodes present when its walk starts (nodes a rewrite inserts are not
    revisited). Counts are ``{"rewritten": r, "missed": k}``; ``rewrites.md`` lists the outcomes."""

    def __init__(
        self,
        name: str,
        rules: Sequence[RewriteRule],
        *,
        description: str = "",
        runs_after: Iterable[str] = (),
        runs_before: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.rules = tuple(rules)
        self.__doc__ = inspect.cleandoc(description) if description else None
        self.description = " ".join(self.__doc__.split("\n\n")[0].split()) if self.__doc__ else ""
        self.runs_after = tuple(runs_after)
        self.runs_before = tuple(runs_before)

    def __call__(self, program: Any) -> PassResult:
        graph_module = program.graph_module
        outcomes = [outcome for rule in self.rules for outcome in self._apply(rule, graph_module.graph)]
        rewritten = sum(o.reason is None for o in outcomes)
        if rewritten:
            graph_module.graph.lint()
            graph_module.recompile()
        counts = {"rewritten": rewritten, "missed": len(outcomes) - rewritten}
        return PassResult(program, modified=bool(rewritten), counts=counts, files={"rewrites.md": self.table(outcomes)})

    def _apply(self, rule: RewriteRule, graph: Graph) -> list[Outcome]:
        outcomes = []
        for node in list(graph.nodes):
            if not rule.matches(node):
                continue
            outcome = Outcome(node.name, str(node.target), rule.name, rule.check(node))
            if outcome.reason is None:
                rule.rewrite(graph, node)
            elif rule.warn_on_miss:
                logger.warning("%s: left %s (%s)", self.name, node.name, outcome.reason)
            outcomes.append(outcome)
        return outcomes

    def table(self, outcomes: Sequence[Outcome]) -> str:
        """The outcomes as a markdown table, one row per matched node."""
        rewritten = sum(o.reason is None for o in outcomes)
        lines = [f"# {self.name}: {rewritten} rewritten, {len(outcomes) - rewritten} missed", ""]
        if not outcomes:
            rules = ", ".join(rule.name for rule in self.rules)
            return "\n".join([*lines, f"No node matched the rules ({rules}).", ""])
        lines += ["| node | target | rule | result |", "| --- | --- | --- | --- |"]
        for o in outcomes:
            result = "rewritten" if o.reason is None else f"missed: {o.reason}"
            cells = [o.node, o.target, o.rule, result]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        return "\n".join(lines) + "\n"


def rule_pass(
    name: str,
    rules: Sequence[RewriteRule],
    *,
    description: str = "",
    runs_after: Iterable[str] = (),
    runs_before: Iterable[str] = (),
    remove_when: str = "",
) -> RulePass:
    """Register a :class:`RulePass` named ``name`` applying ``rules``. ``description`` is the
    pass's docstring: its first paragraph becomes the one-line description listed by the CLI."""
    rule_pass = RulePass(name, rules, description=description, runs_after=runs_after, runs_before=runs_before)
    rule_pass.remove_when = remove_when
    return register_pass(rule_pass)
