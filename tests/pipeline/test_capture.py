"""Capture: patches restored on every path, attention check, specialisation warning, shapes table."""

import logging

import pytest
import torch
from models import build, sample_inputs

from hfexport import PATCHES, CaptureError, DynamoConfig, DynamoExporter, UnsupportedModelError, patches_applied


def _targets(scope="capture"):
    found = {}
    for patch in PATCHES.values():
        if patch.scope != scope:
            continue
        for owner, attribute in patch.owners():
            found[patch.name, id(owner)] = (vars(owner).get(attribute, None), getattr(owner, attribute))
    return found


def test_failed_capture_restores_every_patch(monkeypatch):
    assert PATCHES, "at least one patch is registered"
    originals = _targets()
    seen_inside = {}

    def failing_export(*args, **kwargs):
        seen_inside.update(_targets())
        raise RuntimeError("capture failed on purpose")

    monkeypatch.setattr(torch.export, "export", failing_export)
    model = build("tiny-llama")
    with pytest.raises(CaptureError, match="capture failed on purpose"):
        DynamoExporter().export(model, sample_inputs(model))
    assert seen_inside and all(seen_inside[n][1] is not originals[n][1] for n in originals), "patches were on"
    assert _targets() == originals


def test_patches_restore_inherited_attributes():
    from hfexport.pipeline.patches import Patch

    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    import sys
    import types

    module = types.ModuleType("hfexport_test_patch_target")
    module.Child = Child
    sys.modules[module.__name__] = module
    try:
        PATCHES["test_inherited"] = Patch(
            "test_inherited", f"{module.__name__}:Child.f", lambda orig: lambda self: "patched", "test", "none"
        )
        with patches_applied(["test_inherited"]):
            assert Child().f() == "patched"
        assert "f" not in vars(Child) and Child().f() == "base"
    finally:
        del PATCHES["test_inherited"]
        del sys.modules[module.__name__]


def test_sdpa_patch_matches_unpatched_numerics():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with patches_applied(["sdpa_math_backend_on_cpu"]):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


class _SelectedPatchesAttention(torch.nn.Module):
    def forward(self, x, keep, mask):
        rows = x[keep]  # a data-dependent number of rows, as a vision tower's selected patches
        return torch.nn.functional.scaled_dot_product_attention(rows, rows, rows, attn_mask=mask[keep])


def test_sdpa_patch_takes_the_math_backend_only_for_data_dependent_sizes(monkeypatch):
    import functools

    import torch.nn.attention as attention

    chosen = []
    original = attention.sdpa_kernel

    @functools.wraps(original)
    def recording(backends, *args, **kwargs):
        chosen.append(backends)
        return original(backends, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_kernel", recording)
    inputs = (torch.randn(3, 4, 5, 8), torch.tensor([True, False, True]), torch.rand(3, 1, 5, 5) > 0.3)
    with patches_applied(["sdpa_math_backend_on_cpu"]):
        program = torch.export.export(_SelectedPatchesAttention(), inputs, strict=False)
        assert chosen and all(backend == attention.SDPBackend.MATH for backend in chosen)
        traced = len(chosen)
        q = torch.randn(2, 4, 5, 8)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)  # plain sizes: the fused kernels
        assert len(chosen) == traced
    torch.testing.assert_close(program.module()(*inputs), _SelectedPatchesAttention()(*inputs))


def test_grouped_query_attention_is_captured_as_sdpa_with_enable_gqa():
    # tiny-llama: 4 query heads over 2 key/value heads; no passes, so the capture is what is seen
    model = build("tiny-llama")
    inputs = sample_inputs(model)
    program = DynamoExporter().export(model, inputs, DynamoConfig(dynamic=True, verify=True, passes=[]))
    sdpa = [n for n in program.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == model.config.num_hidden_layers
    assert all(n.kwargs.get("enable_gqa") for n in sdpa)
    # keys and values are the 2 KV heads themselves, not repeat_kv copies
    assert [n.args[1].meta["val"].shape[1] for n in sdpa] == [2] * len(sdpa)
    assert [n.args[2].meta["val"].shape[1] for n in sdpa] == [2] * len(sdpa)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
def test_unexportable_attention_is_a_clear_error(implementation):
    model = build("tiny-llama")
    model.config._attn_implementation = implementation
    with pytest.raises(UnsupportedModelError, match=f"{implementation}.*'sdpa'.*'eager'"):
        DynamoExporter().export(model, sample_inputs(model))
    assert model.config._attn_implementation == implementation


def test_eager_attention_exports():
    model = build("tiny-llama")
    model.config._attn_implementation = "eager"
    inputs = sample_inputs(model)
    program = DynamoExporter().export(model, inputs, DynamoConfig(dynamic=True, verify=True))
    assert not any("scaled_dot_product" in str(n.target) for n in program.graph.nodes)


def test_specialised_dynamic_axis_is_warned_once_by_name(caplog):
    model = build("tiny-llama")
    caplog.set_level(logging.WARNING, logger="hfexport")
    torch_lines = []
    torch_logger = logging.getLogger("torch._export.non_strict_utils")
    handler = logging.Handler()
    handler.emit = lambda record: torch_lines.append(record.getMessage())
    torch_logger.addHandler(handler)
    try:
        result = DynamoExporter().run(model, sample_inputs(model, 2, 1), DynamoConfig(dynamic=True))
    finally:
        torch_logger.removeHandler(handler)
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "hfexport" and "asked to be dynamic" in r.getMessage()
    ]
    assert [w for w in warnings if "'input_ids'" in w] == [
        "input 'input_ids': axes 1 were asked to be dynamic, but the program takes only the sample's sizes 1: "
        "torch.export fixes axes of size 0 and 1: export from a sample where each is larger than 1"
    ]
    assert not [line for line in torch_lines if "0/1 specialized" in line]  # torch's own lines are dropped
    rows = {(a.input, a.axis): a for a in result.input_axes}
    assert not rows[("input_ids", 1)].dynamic and rows[("input_ids", 1)].requested_dynamic
    assert rows[("input_ids", 0)].dynamic


def test_a_one_row_sample_keeps_the_batch_axis_dynamic(caplog):
    model = build("tiny-llama")
    caplog.set_level(logging.WARNING, logger="hfexport")
    sample = sample_inputs(model, 1, 8)
    result = DynamoExporter().run(model, sample, DynamoConfig(dynamic=True, verify=True))
    assert not [r for r in caplog.records if "asked to be dynamic" in r.getMessage()]
    rows = {(a.input, a.axis): a for a in result.input_axes}
    assert rows[("input_ids", 0)].dynamic and rows[("input_ids", 0)].size == 1  # the caller's sample size
    assert "widened to two rows" in result.record("capture").note
    assert result.record("capture").max_abs_diff <= 1e-4  # checked on the caller's own one-row sample
    for batch, seq in [(3, 5), (1, 8)]:
        inputs = sample_inputs(model, batch, seq, seed=batch)
        with torch.no_grad():
            got = result.program.module()(**inputs).logits
            torch.testing.assert_close(got, model(**inputs).logits, atol=1e-4, rtol=0)
    assert sample["input_ids"].shape == (1, 8)  # the caller's inputs are untouched


def test_widening_needs_one_row_everywhere():
    from hfexport.pipeline.inputs import widen_batch

    one = {"input_ids": torch.ones(1, 4, dtype=torch.long), "cache_position": torch.arange(4)}
    widened = widen_batch(one)
    assert widened["input_ids"].shape == (2, 4) and widened["cache_position"].shape == (4,)
    assert one["input_ids"].shape == (1, 4)
    # rope position ids led by 3 sections: axis 0 is not the batch
    assert widen_batch({"input_ids": torch.ones(1, 4), "position_ids": torch.ones(3, 1, 4)}) is None


def test_input_axes_table_has_explicit_bounds():
    model = build("tiny-llama")
    seq = torch.export.Dim("seq", min=2, max=64)
    config = DynamoConfig(
        dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    result = DynamoExporter().run(model, sample_inputs(model), config)
    rows = {(a.input, a.axis): a for a in result.input_axes}
    assert (rows[("input_ids", 1)].min, rows[("input_ids", 1)].max) == (2, 64)
    assert not rows[("input_ids", 0)].dynamic and not rows[("input_ids", 0)].requested_dynamic
    assert "dynamic [2, 64]" in result.report


def test_non_mapping_inputs_are_rejected():
    model = build("tiny-llama")
    with pytest.raises(ValueError, match="mapping of the model's keyword arguments"):
        DynamoExporter().export(model, (sample_inputs(model)["input_ids"],))


def test_qwen2_vl_vision_attention_patch_matches_per_image_attention(monkeypatch):
    # two images of different sizes: the patched attention must keep each image to itself
    from models import build_qwen2_vl

    import hfexport.models.patches as patches_module
    from hfexport.pipeline.patches import patches_applied

    model, _ = build_qwen2_vl()
    encoder = model.get_encoder(modality="image")
    grid = torch.tensor([[1, 2, 2], [1, 4, 4]])
    patches = torch.randn(20, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    masks = []
    original = patches_module.segment_mask
    monkeypatch.setattr(patches_module, "segment_mask", lambda *a: masks.append(a) or original(*a))
    with torch.no_grad():
        expected = encoder(patches, grid).pooler_output
        assert not masks
        with patches_applied(["packed_attention_branch", "packed_sequences_as_sdpa_masks"]):
            patched = encoder(patches, grid).pooler_output
    assert len(masks) == len(encoder.blocks)  # every block attended once over the packed patches
    assert patched.shape == (5, 64)
    torch.testing.assert_close(patched, expected, atol=1e-5, rtol=0)


class ShorterWhenExporting(torch.nn.Module):
    def forward(self, x):
        return x[:, :1] * 2 if torch.compiler.is_exporting() else x * 2


def test_a_program_unlike_eager_in_structure_says_how():
    # the check that the program follows eager on its sample said "differs from eager (max abs diff
    # inf)" for outputs of another shape, and for a program that raised on its own sample
    with pytest.raises(CaptureError, match=r"own sample \(output 0 has shape \[2, 1\] where eager's has \[2, 3\]\)"):
        DynamoExporter().export(ShorterWhenExporting(), {"x": torch.randn(2, 3)}, DynamoConfig())
