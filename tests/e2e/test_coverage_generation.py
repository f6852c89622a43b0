"""The coverage sweep's generation cases for failure classes it found, each a tiny random model
built as the sweep builds it, exported with ``hfexport export --generation`` and decoded through
``hfexport.load`` against ``model.generate`` (``benchmarks/coverage.py``'s own case code). Apart
from ``test_coverage_sample.py`` so that ``make test``'s two workers share them."""

import pytest
from sweep_case import coverage, run_case


def test_a_multi_query_model_generates_on_executorch():
    """GPT-BigCode keeps one key/value head: its cache laid out for the attention kernel kept the
    strides of a size-one axis, from which ExecuTorch read another dim order than the rows written
    into it (index_put_: "2 input tensors have different dim orders"); generate failed at run time."""
    rows = run_case("gpt_bigcode", (), ("generate:executorch",))
    assert rows["generate:executorch"]["status"] == "pass", rows["generate:executorch"]
    assert len(set(rows["generate:executorch"]["expected"])) >= 3  # varied tokens, not one repeated


@pytest.mark.slow  # 102 s: make test-all (GLM-4V below covers the decode loops on every target)
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


def test_a_prefix_language_model_is_refused_for_generation_by_name():
    """PaliGemma's text prompt attends both ways (a prefix LM); the decode loops feed the prompt
    through the decode graph causally, and every target generated other tokens than
    ``model.generate``, silently, once its sample prompt fitted the cache."""
    rows = run_case("paligemma", (), ("generate:dynamo",))
    assert rows["generate:dynamo"]["status"] == "export_error", rows["generate:dynamo"]
    assert "attend to later prompt tokens" in rows["generate:dynamo"]["cause"]


def test_a_decoder_without_a_cache_generates_on_every_target():
    """GPT-1's forward takes no past keys and values (generate runs the whole sequence at each
    step): its generation export was refused ("generates without a cache"). Its decode graph now
    takes the whole sequence, and the loops run it so."""
    generation = tuple(f"generate:{t}" for t in coverage.TARGETS)
    rows = run_case("openai-gpt", (), generation)
    for target in generation:
        assert rows[target]["status"] == "pass", rows[target]
        assert len(set(rows[target]["expected"])) >= 3, rows[target]


def test_a_bert2bert_model_generates_on_dynamo_and_onnx():
    """EncoderDecoderModel's BERT decoder slices its position table by the cache length: a decode
    traced on two merged tokens kept a runtime check that the slice is at least two long, and the
    one-token steps of the encoder-decoder loop failed it ("Runtime assertion failed for expression
    u2 >= 2"). The command line exports an encoder-decoder's decode for one token per step."""
    rows = run_case("encoder-decoder", (), ("generate:dynamo", "generate:onnx"))
    for target in ("generate:dynamo", "generate:onnx"):
        assert rows[target]["status"] == "pass", rows[target]


def test_a_document_model_with_word_boxes_exports_and_generates():
    """UDOP reads each word's box (``bbox``) and its page image: it kept the image patches no box
    points at in Python loops over the tensors (capture failed: "data is not allocated yet"), the
    command line's sample called its tokenizer without boxes ("You must provide corresponding
    bounding boxes") and without the page image, and its decoder steps took the encoder's ``bbox``
    as an input the loop does not feed."""
    rows = run_case("udop", ("dynamo",), ("generate:dynamo",))
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]
    assert len(set(rows["generate:dynamo"]["expected"])) >= 3, rows["generate:dynamo"]


@pytest.mark.slow  # 50 s: make test-all (tests/models/test_tiny.py checks its sample in make test)
def test_a_model_reading_its_image_as_flattened_patches_beside_text_generates():
    """Kosmos-2.5 takes text and its image as flattened patches, placed where
    ``image_embeds_position_mask`` marks: the sweep gave it text only, so generate never ran its
    image encoder and the generation export failed ("generate never called ... image_encoder")."""
    rows = run_case("kosmos-2.5", ("dynamo",), ("generate:dynamo",))
    assert {"flattened_patches", "image_embeds_position_mask"} <= set(rows["eager"]["inputs"]), rows["eager"]
    assert rows["eager"]["kind"] == "multimodal"
    assert rows["dynamo"]["status"] == "pass", rows["dynamo"]
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]
    assert len(set(rows["generate:dynamo"]["expected"])) >= 3, rows["generate:dynamo"]


def test_a_decoder_offsetting_positions_by_the_cache_counter_generates_greedily():
    """FSMT offsets its sinusoidal positions by cache.get_seq_length(), a static cache's counter
    tensor, and grows its table in a Python if on it: the decode capture failed (Could not guard on
    Eq(u0, 1)). Its generation config asks for five beams, which the export recorded as five rows
    and the loop did not apply: the reference and the loops are greedy (num_beams=1)."""
    rows = run_case("fsmt", (), ("generate:dynamo",))
    assert rows["generate:dynamo"]["status"] == "pass", rows["generate:dynamo"]
    assert len(set(rows["generate:dynamo"]["expected"])) >= 3, rows["generate:dynamo"]
