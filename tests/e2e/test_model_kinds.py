"""Models without a text embedding table (a dual encoder, a vision model, an audio model) export to
every target from one capture and match eager on the sample and on a second shape.

Before the frontend asked for the embedding table defensively, each of these failed before tracing
with transformers' ``NotImplementedError: get_input_embeddings not auto-handled``; Hubert's
feature extractor then failed XNNPACK's serialisation of its 1-D convolutions
(``dynamic_conv1d_as_conv2d``).
"""

import pytest
import torch
import transformers

from hfexport import DynamoConfig, ExecutorchConfig, ExportFolder, OnnxConfig, run_targets, save_export

TEXT = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4}


def clip() -> tuple[torch.nn.Module, callable]:
    config = transformers.CLIPConfig(
        text_config={**TEXT, **HEADS, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 2},
        vision_config={**TEXT, **HEADS, "image_size": 30, "patch_size": 2},
    )

    def inputs(batch: int, seq: int) -> dict:
        generator = torch.Generator().manual_seed(batch * 100 + seq)
        return {
            "input_ids": torch.randint(0, 99, (batch, seq), generator=generator),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "pixel_values": torch.randn(batch, 3, 30, 30, generator=generator),
        }

    return transformers.CLIPModel(config), inputs


def convnext() -> tuple[torch.nn.Module, callable]:
    config = transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=3)

    def inputs(batch: int, seq: int) -> dict:
        size = 32 + 8 * (seq % 2)
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seq))}

    return transformers.ConvNextForImageClassification(config), inputs


def hubert() -> tuple[torch.nn.Module, callable]:
    config = transformers.HubertConfig(
        **{k: v for k, v in TEXT.items() if k != "vocab_size"},
        **HEADS,
        conv_dim=(8, 8),
        conv_stride=(4, 4),
        conv_kernel=(8, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )

    def inputs(batch: int, seq: int) -> dict:
        return {"input_values": torch.randn(batch, 100 * seq, generator=torch.Generator().manual_seed(seq))}

    return transformers.HubertModel(config), inputs


def main_output(outputs) -> torch.Tensor:
    return next(iter(outputs.values()))


@pytest.mark.parametrize("build", [clip, convnext, hubert], ids=["clip", "convnext", "hubert"])
def test_exports_to_every_target_and_matches_eager_on_two_shapes(build, tmp_path):
    torch.manual_seed(0)
    model, make_inputs = build()
    model.eval()
    sample, second = make_inputs(2, 8), make_inputs(1, 5)
    configs = [DynamoConfig(dynamic=True), OnnxConfig(dynamic=True), ExecutorchConfig(dynamic=True)]
    results = run_targets(model, sample, configs)
    for target, result in results.items():
        save_export(tmp_path / target, {"model": result})
        runner = ExportFolder(tmp_path / target).runner()
        for inputs in (sample, second):
            with torch.no_grad():
                expected = main_output(model(**inputs))
            got = torch.as_tensor(runner.run(inputs)[0])
            tolerance = 1e-4 if target == "dynamo" else 1e-3
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=0, msg=f"{target}")
