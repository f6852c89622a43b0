"""The coverage sweep's fixed sample: a few architectures of every kind, each built as the sweep
builds it (a tiny random model from its config, config-made inputs), exported to every target from
one capture and compared with eager on two shapes by the sweep's own case code
(``benchmarks/coverage.py``; ``make coverage`` runs every type)."""

import pytest
from sweep_case import coverage, run_case

SAMPLE = {
    "gpt2": "decoder LM",
    "bert": "encoder",
    "t5": "encoder-decoder",
    "convnext": "vision",  # no text embedding table: failed before tracing until the frontend asked defensively
    "hubert": "audio",  # 1-D convolutions over a dynamic batch and length (dynamic_conv1d_as_conv2d)
    "clip": "multimodal",
    "mamba": "SSM / hybrid",
}
# Mamba's selective scan is exported as a scan op (patch selective_scan_as_scan_op; the Python loop
# had fixed the sequence length): any length on Dynamo and ONNX. ExecuTorch's runtime cannot run a
# scan whose state has a dynamic batch, which the export refuses by name (not a program that fails)
REFUSED = {("mamba", "executorch"): "recurrence (a scan)"}


# make test's time: the encoder-decoder kind is exported to every target there by
# tests/e2e/test_seq2seq_generation.py (T5, Bart, Whisper), so its sweep case is left to make test-all
SLOW = {"t5"}


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW else t for t in SAMPLE])
def test_every_target_matches_eager_on_two_shapes(model_type):
    rows = run_case(model_type)
    assert rows["eager"]["status"] == "ok" and rows["eager"]["kind"] == SAMPLE[model_type]
    found = {t: (rows[t]["status"], rows[t].get("cause"), rows[t].get("diff")) for t in coverage.TARGETS}
    for target, (status, cause, _) in found.items():
        if (model_type, target) in REFUSED:
            assert status == "export_error" and REFUSED[model_type, target] in cause, found
        else:
            assert status == "pass", found


def test_a_mask_made_from_a_custom_mask_function_saves_and_stays_dynamic():
    """Gemma 3's image tokens attend both ways through a mask function that transformers vmaps; the
    program held an unsavable flat_apply (SerializeError in save_export) until the mask is made by
    broadcasting (patches mask_functions_by_broadcasting / mask_functions_index_as_tensor_ops)."""
    rows = run_case("gemma3", ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_model_returning_a_cache_outside_caches_hierarchy_exports():
    """Voxtral Realtime returns its own VoxtralRealtimeConv1dPaddingCache, which is no subclass of
    transformers' Cache: capture failed ("not a known type") until caches named by transformers'
    convention are registered as pytrees too."""
    rows = run_case("voxtral_realtime", ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_vision_tower_attending_within_each_image_exports_for_any_number_of_images():
    """Qwen3-VL's vision tower splits its packed patches per image with cu_seqlens.tolist() (30-odd
    modeling files share the code) and its text positions come from get_rope_index, which walks the
    ids in Python: capture failed (GuardOnDataDependentSymNode). With the packed attention as one
    masked SDPA and the positions an input, the program matches eager. Its position ids, its
    position-embedding interpolation and its per-image split of the features then fixed the number
    of images to the sample's two ("image_grid_thw axis 0 ... static size 2" for the second shape's
    three); per token and deferred, any number runs, on ONNX Runtime too."""
    rows = run_case("qwen3_vl", ("dynamo", "onnx"))
    assert "position_ids" in rows["eager"]["inputs"] and rows["eager"]["inputs"]["image_grid_thw"][0] == 2
    for target in ("dynamo", "onnx"):
        assert rows[target]["status"] == "pass", rows[target]
        assert rows[target]["diff2"] <= coverage.TOLERANCE[target], rows[target]


def test_an_image_given_as_flattened_patches_exports_and_its_uncached_generation_is_refused():
    """Pix2Struct takes its image as flattened patches ([row, column, pixels...] rows): the sweep
    gave it none ("You have to specify flattened_patches"). Its generate ignores a static cache and
    runs the whole decoder sequence again at each step; the encoder's outputs (a tuple of tensors)
    were taken for a cache, and the folder failed at generate ("takes no static self-attention
    cache"). Now the generation export is refused in one line."""
    rows = run_case("pix2struct", ("dynamo",), ("generate:dynamo",))
    assert rows["eager"]["status"] == "ok" and "flattened_patches" in rows["eager"]["inputs"], rows["eager"]
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]
    generation = rows["generate:dynamo"]
    assert generation["status"] == "export_error" and "generates without a cache" in generation["cause"], generation


@pytest.mark.parametrize("model_type", ["jamba", "rwkv"])
def test_a_recurrence_over_the_sequence_exports_any_length(model_type):
    """Jamba's selective scan (the Mamba patch had matched Mamba's own modules only) and RWKV's time
    mixing are Python loops over the sequence: the programs took the sample's 8 tokens only
    (second_shape_error), until each loop is torch's scan op (selective_scan_as_scan_op,
    rwkv_recurrence_as_scan_op)."""
    rows = run_case(model_type, ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_program_that_differs_from_eager_on_its_own_sample_is_refused():
    """AIMv2's text tower takes another path under torch.export: eager skips the causal mask for an
    all-ones mask (and its attention then sees both ways), the trace cannot, and the states differ
    by 2.3 on the sample itself. The export succeeded and every target carried a graph that is not
    what eager computes, silently, until capture compares the program with eager on the sample."""
    rows = run_case("aimv2", ("dynamo",))
    assert rows["dynamo"]["status"] == "export_error", rows["dynamo"]
    assert "differs from eager on the sample itself" in rows["dynamo"]["cause"]


def test_a_cache_holding_empty_lists_for_skipped_layers_is_exported():
    """MiniMax's cache keeps ``linear_cache`` as a list of tensors with ``[]`` in the places of its
    attention layers: the cache's pytree flattening took the list for a constant and capture failed
    ("cannot flatten attribute of type FakeTensor into a pytree context")."""
    rows = run_case("minimax", ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_shape_condition_of_the_trace_the_inputs_fail_is_one_line():
    """Nemotron 3.5 Transcribe's code fixes an arithmetic relation of its input length while tracing
    (its chunks of 8 frames), which the manifest's per-axis bounds cannot state: a second length
    reached the user as torch's bare ``AssertionError: Guard failed: ...``."""
    rows = run_case("nemotron3_5_transcribe_audio", ("dynamo",))
    assert rows["dynamo"]["status"] == "second_shape_error", rows["dynamo"]
    assert rows["dynamo"]["cause"].startswith("HfExportError: the inputs' shapes fail a condition"), rows["dynamo"]


@pytest.mark.parametrize("model_type", ["llava", "pixtral"])
def test_a_vision_model_looping_over_its_images_takes_any_number_of_them(model_type):
    """LLaVA's get_image_features returned list(image_features), one piece per image; Pixtral's
    vision encoder cut and positioned each image in a loop: each program took the sample's number
    of images only (patches llava_image_features_split_when_read, pixtral_images_of_one_size_without_a_loop)."""
    rows = run_case(model_type, ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_windowed_vision_transformer_exports_at_its_configured_image_size():
    """Swin's padding and window reshapes over a symbolic height and width grew expressions that
    sympy took minutes to simplify (pytorch/pytorch#141675): no capture within 5 minutes for Swin,
    Swin V2, Swin2SR, Donut and MaskFormer. Images at the size the config names keep it static."""
    from hfexport.models.frontend import TRANSFORMERS
    from hfexport.models.samples import config_sample_inputs
    from hfexport.models.tiny import build_tiny

    model = build_tiny("swin")
    inputs = config_sample_inputs(model)
    assert TRANSFORMERS.static_axes(model, inputs).get("pixel_values") == {2, 3}
    smaller = {"pixel_values": inputs["pixel_values"][..., :32, :32]}
    assert "pixel_values" not in TRANSFORMERS.static_axes(model, smaller)
    rows = run_case("swin", ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_an_encoder_decoder_merging_image_features_first_generates():
    """Florence-2 merges its image features into the text embeddings before its text encoder, so
    generate hands get_encoder() embeddings: the exported encoder took inputs_embeds, and the decode
    loop, fed the prompt's ids and pixels, failed ("unknown input(s) ['pixel_values', 'input_ids']").
    The encoder component is the model's own encoder step from the prompt's inputs. On Dynamo, the
    encoder traced from two images carries guards derived from its batch (its window count, "!= 1")
    that refused the one prompt generation feeds; the runner takes a batch of one where every guard
    holds at two, as the other runtimes do."""
    rows = run_case("florence2", (), ("generate:onnx", "generate:dynamo"))
    for target in ("generate:onnx", "generate:dynamo"):
        assert rows[target]["status"] == "pass", rows[target]
        assert rows[target]["got"] == rows[target]["expected"]


def test_a_copy_between_windows_takes_any_window_count():
    """DeepSeek-V4's compressors copy each window's overlap from the window before; at the sample's
    8 tokens there is one such window, and the copy's contiguity check fixed that count: the program
    took at most 11 tokens ("above the exported upper bound 11" at the second shape's 12), where
    transformers' ONNX exporter passes. Traced size-obliviously, ONNX takes any length."""
    rows = run_case("deepseek_v4", ("onnx",))
    assert rows["onnx"]["status"] == "pass", rows["onnx"]
    assert rows["onnx"]["diff2"] <= coverage.TOLERANCE["onnx"], rows["onnx"]
