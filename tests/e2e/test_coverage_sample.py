"""The coverage sweep's fixed sample: a few architectures of every kind, each built as the sweep
builds it (a tiny random model from its config, config-made inputs), exported to every target from
one capture and compared with eager on two shapes by the sweep's own case code
(``benchmarks/coverage.py``; ``make coverage`` runs every type)."""

import importlib.util
import queue
from pathlib import Path

import pytest

# by path: the name "coverage" is also coverage.py's package
_spec = importlib.util.spec_from_file_location(
    "hfexport_coverage_sweep", Path(__file__).resolve().parents[2] / "benchmarks" / "coverage.py"
)
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

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


def run_case(
    model_type: str, targets: tuple[str, ...] = coverage.TARGETS, generation: tuple[str, ...] = ()
) -> dict[str, dict]:
    """The sweep's case in this process: ``{target: row}`` (``"eager"`` included); ``generation``:
    the ``generate:<target>`` cases to run too."""
    results = queue.Queue()
    coverage.run_case(model_type, list(targets), [], list(generation), results)
    rows = {}
    while not results.empty():
        row = results.get_nowait()
        rows[row["target"]] = row
    return rows


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


def test_a_vision_tower_attending_within_each_image_exports():
    """Qwen3-VL's vision tower splits its packed patches per image with cu_seqlens.tolist() (30-odd
    modeling files share the code) and its text positions come from get_rope_index, which walks the
    ids in Python: capture failed (GuardOnDataDependentSymNode). With the packed attention as one
    masked SDPA and the positions an input, the program matches eager; the image count stays the
    sample's (refused by name for another)."""
    rows = run_case("qwen3_vl", ("dynamo",))
    assert "position_ids" in rows["eager"]["inputs"]
    assert rows["dynamo"]["diff"] is not None and rows["dynamo"]["diff"] <= coverage.TOLERANCE["dynamo"], rows
    assert rows["dynamo"]["status"] == "pass" or "image_grid_thw" in rows["dynamo"]["cause"], rows


def test_a_multi_query_model_generates_on_executorch():
    """GPT-BigCode keeps one key/value head: its cache laid out for the attention kernel kept the
    strides of a size-one axis, from which ExecuTorch read another dim order than the rows written
    into it (index_put_: "2 input tensors have different dim orders"); generate failed at run time."""
    rows = run_case("gpt_bigcode", (), ("generate:executorch",))
    assert rows["generate:executorch"]["status"] == "pass", rows["generate:executorch"]
    assert len(set(rows["generate:executorch"]["expected"])) >= 3  # varied tokens, not one repeated


def test_a_hybrid_model_with_windowed_and_linear_attention_generates_on_every_target():
    """Inkling 2's layers hold both attention keys and a linear attention's convolution states
    (``hybrid_sliding``): the full-length windowed static layer had dropped the convolution states
    ("Cannot get conv state for non linear attention layer"), the dynamic shapes of its
    ``{state: tensor}`` dict were read as one tensor's axes, its decode step's unused mask (None)
    was counted as an input, and its decode takes at most three tokens at once."""
    generation = tuple(f"generate:{t}" for t in coverage.TARGETS)
    rows = run_case("inkling2_text", (), generation)
    for target in generation:
        assert rows[target]["status"] == "pass", rows[target]
        assert len(set(rows[target]["expected"])) >= 3, rows[target]


@pytest.mark.parametrize("model_type", ["jamba", "rwkv"])
def test_a_recurrence_over_the_sequence_exports_any_length(model_type):
    """Jamba's selective scan (the Mamba patch had matched Mamba's own modules only) and RWKV's time
    mixing are Python loops over the sequence: the programs took the sample's 8 tokens only
    (second_shape_error), until each loop is torch's scan op (selective_scan_as_scan_op,
    rwkv_recurrence_as_scan_op)."""
    rows = run_case(model_type, ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_multimodal_model_with_four_rotary_rows_generates_on_every_target():
    """GLM-4V's decode step takes its multimodal rotary positions as [4, batch, queries] and its
    image-token marks (mm_token_type_ids): the decode loops passed [batch, queries] positions
    ("Guard failed: position_ids.size()[0] == 4") and no marks, and the ExecuTorch sample kept two
    rows (flattened image patches cannot be cut to one)."""
    generation = tuple(f"generate:{t}" for t in coverage.TARGETS)
    rows = run_case("glm4v", (), generation)
    for target in generation:
        assert rows[target]["status"] == "pass", rows[target]


def test_an_encoder_decoder_reading_its_encoder_outputs_by_name_generates():
    """Cohere ASR's decoder reads ``encoder_outputs.last_hidden_state`` and ``.attention_mask``: the
    prefill capture failed on the plain tuple the encoder's outputs became ("'tuple' object has no
    attribute 'last_hidden_state'"; Canary and Florence-2 too), and its folder named no start token
    where the config held a null ``decoder_start_token_id`` beside a ``bos_token_id``."""
    rows = run_case("cohere_asr", (), ("generate:dynamo",))
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]


def test_a_program_that_differs_from_eager_on_its_own_sample_is_refused():
    """AIMv2's text tower takes another path under torch.export: eager skips the causal mask for an
    all-ones mask (and its attention then sees both ways), the trace cannot, and the states differ
    by 2.3 on the sample itself. The export succeeded and every target carried a graph that is not
    what eager computes, silently, until capture compares the program with eager on the sample."""
    rows = run_case("aimv2", ("dynamo",))
    assert rows["dynamo"]["status"] == "export_error", rows["dynamo"]
    assert "differs from eager on the sample itself" in rows["dynamo"]["cause"]


def test_a_layer_type_without_a_static_cache_layer_is_refused_by_name():
    """DeepSeek-V4's compressed attention layers have no static cache layer in transformers:
    recording its components stopped inside generate with a bare ``KeyError:
    'heavily_compressed_attention'`` on every target."""
    rows = run_case("deepseek_v4", (), ("generate:dynamo",))
    assert rows["generate:dynamo"]["status"] == "export_error", rows["generate:dynamo"]
    assert (
        "'heavily_compressed_attention'] for which transformers has no static cache layer"
        in (rows["generate:dynamo"]["cause"])
    )


def test_an_encoder_decoder_with_a_mask_per_layer_type_generates():
    """T5Gemma's decoder takes ``decoder_attention_mask`` as one mask per layer type (full and
    sliding attention): the encoder-decoder loop refused the folder ("takes an input
    'decoder_attention_mask.sliding_attention' ... that hfexport's encoder-decoder loop does not
    feed") until it built them as the decoder-only loops do."""
    rows = run_case("t5gemma", (), ("generate:dynamo",))
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]


def test_a_decoder_counting_positions_from_its_cache_generates():
    """TrOCR's decoder takes no ``position_ids`` (its learned positions count from the cache): the
    Dynamo and ONNX decode loops passed them anyway ("kwarg keyword mismatch", ``KeyError:
    'position_ids'``)."""
    rows = run_case("trocr", (), ("generate:dynamo", "generate:onnx"))
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]
    assert rows["generate:onnx"]["status"] == "pass", rows["generate:onnx"]


def test_a_recurrent_state_model_from_the_command_line_generates():
    """RWKV carries ``state.*``, no attention cache: the decode loops refused every folder ("carries
    a recurrent state"), and the command line's export dropped its prefill (its decode takes
    several tokens), the only program that starts the state (RWKV's initial state is its own)."""
    rows = run_case("rwkv", (), ("generate:dynamo", "generate:onnx"))
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]
    assert rows["generate:onnx"]["status"] == "pass", rows["generate:onnx"]


def test_a_cache_holding_empty_lists_for_skipped_layers_is_exported():
    """MiniMax's cache keeps ``linear_cache`` as a list of tensors with ``[]`` in the places of its
    attention layers: the cache's pytree flattening took the list for a constant and capture failed
    ("cannot flatten attribute of type FakeTensor into a pytree context")."""
    rows = run_case("minimax", ("dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]


def test_a_shape_condition_of_the_trace_the_inputs_fail_is_one_line():
    """SEW's code fixes an arithmetic relation of its input length while tracing, which the
    manifest's per-axis bounds cannot state: a second length reached the user as torch's bare
    ``AssertionError: Guard failed: ...``."""
    rows = run_case("sew", ("dynamo",))
    assert rows["dynamo"]["status"] == "second_shape_error", rows["dynamo"]
    assert rows["dynamo"]["cause"].startswith("HfExportError: the inputs' shapes fail a condition"), rows["dynamo"]
