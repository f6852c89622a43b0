"""Patches of torch modules for capture: each numerically equal to the module it replaces, and the
captured program takes other shapes."""

import pytest
import torch

import hfexport.models  # noqa: F401  registers the patches
from hfexport.pipeline.patches import patches_applied


@pytest.mark.parametrize(
    "options",
    [
        {"batch_first": True},
        {"num_layers": 2, "bidirectional": True},
        {"batch_first": True, "bidirectional": True, "bias": False},
    ],
)
def test_an_lstm_exports_for_any_sequence_length(options):
    # torch.export unrolls nn.LSTM over the sample's time steps: the program took that length only
    # (Parakeet's transducer predictor); as a scan it takes any
    lstm = torch.nn.LSTM(8, 6, **options).eval()
    time_axis = 1 if options.get("batch_first") else 0

    def sample(batch, steps):
        shape = [batch, steps, 8] if time_axis == 1 else [steps, batch, 8]
        return torch.randn(*shape)

    x = sample(2, 5)
    with patches_applied(["lstm_as_scan_op"]):
        patched = lstm(x)
        program = torch.export.export(
            lstm, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
        )
    eager = lstm(x)
    for got, expected in zip((patched[0], *patched[1]), (eager[0], *eager[1]), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    longer = sample(3, 9)
    torch.testing.assert_close(program.module()(longer)[0], lstm(longer)[0], atol=1e-6, rtol=1e-5)


def test_an_lstm_with_a_given_state_or_unbatched_input_matches():
    lstm = torch.nn.LSTM(8, 6).eval()
    x, state = torch.randn(5, 8), (torch.randn(1, 6), torch.randn(1, 6))
    with patches_applied(["lstm_as_scan_op"]):
        output, (h, c) = lstm(x, state)
    expected, (h_expected, c_expected) = lstm(x, state)
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h, h_expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c, c_expected, atol=1e-6, rtol=1e-5)


def test_a_forward_casting_a_submodule_to_its_own_dtype_exports():
    # SwitchTransformers' router runs self.classifier = self.classifier.to(self.dtype) in its forward:
    # non-strict export failed with "_apply(): Couldn't swap Linear.weight"
    class Router(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.classifier = self.classifier.to(torch.float32)
            return self.classifier(x)

    router, x = Router().eval(), torch.randn(2, 4)
    with patches_applied(["module_to_without_change"]):
        program = torch.export.export(router, (x,), strict=False)
    torch.testing.assert_close(program.module()(x), router(x), atol=0, rtol=0)
    assert router.to(torch.float64).classifier.weight.dtype == torch.float64  # a real cast still casts


def test_switch_transformers_experts_run_densely_with_the_same_sums():
    # the experts loop over nonzero() of the routing: the trace stopped at "Could not guard on Eq(u0, 0)"
    from hfexport.models.tiny import build_tiny

    model = build_tiny("switch_transformers").eval()
    mlp = next(m for m in model.modules() if type(m).__name__ == "SwitchTransformersSparseMLP")
    mlp.router.expert_capacity = 3  # some tokens over capacity: routed to no expert
    hidden = torch.randn(2, 5, model.config.d_model)
    with torch.no_grad():
        expected = mlp(hidden)
        with patches_applied(["switch_experts_dense", "module_to_without_change"]):
            dense = mlp(hidden)
            program = torch.export.export(
                mlp, (hidden,), dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},), strict=False
            )
        longer = torch.randn(3, 9, model.config.d_model)
        torch.testing.assert_close(dense, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(program.module()(longer), mlp(longer), atol=1e-6, rtol=1e-5)


def test_experts_on_the_eager_implementation_export_as_batched_mm():
    # OpenAI Privacy Filter keeps its experts on transformers' eager loop over nonzero(): the trace
    # stopped at "Could not guard on data-dependent expression Eq(u0, 0)"
    from hfexport.models.tiny import build_tiny

    model = build_tiny("openai_privacy_filter").eval()
    experts = next(m for m in model.modules() if type(m).__name__ == "OpenAIPrivacyFilterExperts")
    assert model.config._experts_implementation == "eager"
    calls = []
    handle = experts.register_forward_pre_hook(lambda module, args: calls.append(args))
    with torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (2, 7)))
        model(input_ids=torch.randint(0, model.config.vocab_size, (3, 11)))
    handle.remove()
    sample, other = calls[0], calls[-1]
    dims = tuple({0: torch.export.Dim.AUTO} for _ in sample)
    with torch.no_grad():
        with patches_applied(["eager_experts_as_batched_mm"]):
            program = torch.export.export(experts, sample, dynamic_shapes=dims, strict=False)
        torch.testing.assert_close(program.module()(*other), experts(*other), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("batch", "words", "max_len"), [(2, 8, 0), (3, 5, 0), (2, 8, 30), (2, 8, 12)])
def test_udop_keeps_the_unpointed_patches_without_python_loops(batch, words, max_len):
    # UDOP's combine_image_text_embeddings walked the tensors in Python (zip(*ind), a boolean index
    # per row): capture failed ("data is not allocated yet"); scattered by rank it gives eager's rows
    from transformers.models.udop import modeling_udop

    generator = torch.Generator().manual_seed(batch * words + max_len)
    images = torch.randn(batch, 16, 6, generator=generator)
    texts = torch.randn(batch, words, 6, generator=generator)
    boxes = torch.rand(batch, words, 4, generator=generator)
    boxes[0, 0], boxes[1, 1] = 0.0, 1.0  # a box the model takes for a whole-page segment
    boxes[0, 2] = boxes[0, 3]  # two words on one patch
    mask = torch.ones(batch, words, dtype=torch.long)
    call = (images, None, mask, 4, max_len, 64, 16)
    eager = modeling_udop.combine_image_text_embeddings(images, texts.clone(), boxes, *call[1:])
    with patches_applied(["udop_patches_by_scatter"]):
        patched = modeling_udop.combine_image_text_embeddings(images, texts.clone(), boxes, *call[1:])
    for got, expected in zip(patched, eager, strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "options",
    [{"kernel_size": 2}, {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}, {"kernel_size": [2]}],
)
def test_max_pool1d_takes_any_length(options):
    # aten.max_pool1d fixed the length to the sample's (Eq(s27, 7)): SEW pools its attention mask
    # with it, so its program took one waveform length
    class Pool(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pooled, where = torch.nn.functional.max_pool1d(x, return_indices=True, **options)
            return pooled, where

    x = torch.randn(2, 3, 7)
    with patches_applied(["max_pool1d_as_max_pool2d"]):
        program = torch.export.export(
            Pool(), (x,), dynamic_shapes=({0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO},)
        )
    for longer in (x, torch.randn(3, 3, 12)):
        for got, expected in zip(program.module()(longer), Pool()(longer), strict=True):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("causal, pad_mode", [(True, "reflect"), (False, "reflect"), (True, "constant")])
def test_codec_convolutions_pad_any_length_with_the_same_numbers(causal, pad_mode):
    # EnCodec's padded convolution (and WavTokenizer's, Pocket TTS's, Mimi's) computed its paddings
    # from integer buffers: .item() during capture, GuardOnDataDependentSymNode in _pad1d
    from transformers import EncodecConfig
    from transformers.models.encodec.modeling_encodec import EncodecConv1d

    config = EncodecConfig(use_causal_conv=causal, pad_mode=pad_mode)
    conv = EncodecConv1d(config, 2, 3, kernel_size=7, stride=3, dilation=1).eval()
    x = torch.randn(2, 2, 23)
    with patches_applied(["encodec_conv_padding_in_integers"]):
        program = torch.export.export(
            conv, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO},)
        )
    for length in (23, 24, 40):
        sample = torch.randn(3, 2, length)
        assert torch.equal(program.module()(sample), conv(sample))


def test_cpmant_attention_mask_is_the_same_for_any_length():
    # CPM-Ant counted its left padding down with torch.tensor(list(range(n))[::-1]): the program took
    # the sample's length only (Eq(s70, 8))
    from transformers import CpmAntConfig
    from transformers.models.cpmant.modeling_cpmant import CpmAntModel

    model = CpmAntModel(CpmAntConfig(hidden_size=16, num_attention_heads=2, dim_head=8, num_hidden_layers=1)).eval()
    for seqlen in (5, 9):
        ids = torch.randint(0, 100, (2, seqlen + model.prompt_length))
        span = torch.zeros_like(ids)
        span[1, -2:] = 1
        context = torch.ones_like(ids, dtype=torch.bool)
        context[0, -3:] = False
        length = torch.tensor([seqlen, seqlen - 2])
        expected = model._prepare_attention_mask(ids, span, context, length)
        with patches_applied(["cpmant_padding_mask_from_arange"]):
            assert torch.equal(model._prepare_attention_mask(ids, span, context, length), expected)


def test_reformer_axial_positions_are_the_same_for_any_batch():
    # Reformer selected each row's axial encodings in a Python loop over the batch: the program took
    # the sample's batch only (Eq(s72, 2))
    from transformers import ReformerConfig
    from transformers.models.reformer.modeling_reformer import AxialPositionEmbeddings

    config = ReformerConfig(axial_pos_shape=[4, 8], axial_pos_embds_dim=[6, 10], hidden_size=16)
    embeddings = AxialPositionEmbeddings(config).eval()
    for weight in embeddings.weights:
        torch.nn.init.normal_(weight)
    for batch, length in ((1, 5), (3, 17)):
        positions = torch.arange(length).expand(batch, -1) + torch.arange(batch)[:, None] * 3
        expected = embeddings(positions)
        with patches_applied(["reformer_axial_positions_by_indexing"]):
            assert torch.equal(embeddings(positions), expected)


def test_canine_exports_for_any_number_of_characters():
    # CANINE attended within chunks in a Python loop over the length and fixed its one molecule
    # past the first (a sample of 8 characters): the program took the sample's length only
    from hfexport import DynamoConfig, DynamoExporter
    from hfexport.models.samples import config_sample_inputs
    from hfexport.models.tiny import build_tiny

    torch.manual_seed(0)
    model = build_tiny("canine")
    model.config.local_transformer_stride = 4  # several chunks at these lengths
    for layer in model.canine.initial_char_encoder.layer:
        attention = layer.attention
        attention.attend_from_chunk_width = attention.attend_from_chunk_stride = 4
        attention.attend_to_chunk_width = attention.attend_to_chunk_stride = 4
    program = DynamoExporter().export(model, config_sample_inputs(model), DynamoConfig(dynamic=True))
    for length in (8, 13, 21):
        inputs = config_sample_inputs(model, 3, length, seed=length)
        with torch.no_grad():
            expected = model(**inputs).logits
        torch.testing.assert_close(program.module()(**inputs).logits, expected, atol=1e-5, rtol=1e-5)


def test_ovis2_exports_with_its_visual_indicator_tokens():
    # Ovis2 wrote each indicator token's embedding only `if mask.any()`, a branch on the ids' values:
    # the capture failed (GuardOnDataDependentSymNode)
    from hfexport import DynamoConfig, DynamoExporter
    from hfexport.models.samples import config_sample_inputs
    from hfexport.models.tiny import build_tiny

    torch.manual_seed(0)
    model = build_tiny("ovis2")
    sample = config_sample_inputs(model)
    program = DynamoExporter().export(model, sample, DynamoConfig(dynamic=True))
    first, *others = model.config.visual_indicator_token_ids
    with_indicators = {name: value.clone() for name, value in sample.items()}
    with_indicators["input_ids"][0, -3:] = torch.tensor([first, others[-1], first])  # none in row 1
    with torch.no_grad():
        plain = model(**sample).logits
        expected = model(**with_indicators).logits
        assert (expected[0] - plain[0]).abs().max() > 1e-3  # the indicators change row 0's logits
        torch.testing.assert_close(program.module()(**with_indicators).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(program.module()(**sample).logits, plain, atol=1e-5, rtol=1e-5)
