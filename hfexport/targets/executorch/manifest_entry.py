"""The ExecuTorch program's entry in the export folder's manifest: what the lowering writes and the
runner reads back to bind inputs by name (a ``.pte`` takes them by position). It needs no
executorch package: the program is only asked for its ``exported_program()``."""

from __future__ import annotations

from typing import Any

from hfexport.pipeline.capture import Captured
from hfexport.targets.manifest import ComponentSpec, OutputSpec, captured_facts, program_inputs, program_outputs


def pte_component(program: Any, captured: Captured | None = None) -> ComponentSpec:
    """The manifest entry of an ExecuTorch program: its tensor inputs by keyword path in the
    method's order, and its outputs (the write-back of each input it mutates is
    ``output.<input path>``)."""
    exported = program.exported_program()
    outputs = [
        OutputSpec(f"output.{path}" if kind == "write_back" else path, path, kind, written)
        for path, kind, written in program_outputs(exported)
    ]
    from hfexport.targets.executorch.llm_runner import INTERFACE, POSITIONS

    inputs = program_inputs(exported, captured)
    interface = INTERFACE if any(i.path == POSITIONS for i in inputs) else ""
    return ComponentSpec("", inputs, outputs, **captured_facts(captured), interface=interface)
