"""What a user brings to ``hfexport export MODEL``, with no options: a vision, speech or multimodal
folder, a BERT-family checkpoint fed a sentence pair, an SSM, a folder with its own model code, a
``.gguf`` file. Each program takes the inputs the model reads, in the names and dtypes its own
processors make, and matches eager.

On the code before tasks and processor inputs, each of these failed or exported a wrong program:
the CLI fed every model random ``input_ids`` + ``attention_mask`` (ViT: ``'NoneType' object has
no attribute 'dtype'``; LLaVA: a text-only program; MiniLM: no ``token_type_ids``, which the
tokenizer's output carries), forced SDPA (Mamba has none), had no ``--trust-remote-code``, and
refused a ``.gguf`` path.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers

from hfexport import ExportFolder, load_exported_program

HFEXPORT = [sys.executable, "-m", "hfexport.cli"]
TINY_VISION = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}


def run(*args, check=True, env=None):
    result = subprocess.run(
        [*HFEXPORT, *map(str, args)], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def program_inputs(folder) -> list[str]:
    return [spec.name for spec in ExportFolder(folder).manifest.components["model"].inputs]


def test_vit_folder_exports_pixel_values_from_its_image_processor(tmp_path):
    torch.manual_seed(0)
    config = transformers.ViTConfig(**TINY_VISION, image_size=32, patch_size=4, num_labels=3)
    model = transformers.ViTForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "vit")
    processor = transformers.ViTImageProcessorPil(size={"height": 32, "width": 32})
    processor.save_pretrained(tmp_path / "vit")
    result = run("export", tmp_path / "vit", "--out", tmp_path / "out")
    assert "task image-classification" in result.stderr
    assert program_inputs(tmp_path / "out") == ["pixel_values"]
    images = [np.random.default_rng(i).integers(0, 256, (48, 40, 3), dtype=np.uint8) for i in range(3)]
    pixels = processor(images, return_tensors="pt")["pixel_values"]  # another batch size than the sample
    program = load_exported_program(tmp_path / "out" / "model.pt2")
    with torch.no_grad():
        expected = model(pixel_values=pixels).logits
    torch.testing.assert_close(program.module()(pixel_values=pixels).logits, expected, atol=1e-4, rtol=0)


def test_whisper_folder_exports_input_features_from_its_feature_extractor(tmp_path):
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=50,
        max_target_positions=64,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path / "whisper")
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=1)  # 100 frames
    extractor.save_pretrained(tmp_path / "whisper")
    result = run("export", tmp_path / "whisper", "--out", tmp_path / "out")
    assert "task automatic-speech-recognition" in result.stderr
    assert program_inputs(tmp_path / "out") == ["input_features", "decoder_input_ids"]
    wave = np.random.default_rng(0).standard_normal(12000).astype(np.float32) * 0.1
    inputs = {
        "input_features": extractor(wave, sampling_rate=16000, return_tensors="pt")["input_features"],
        "decoder_input_ids": torch.tensor([[1, 5, 7]]),
    }
    program = load_exported_program(tmp_path / "out" / "model.pt2")
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(program.module()(**inputs).logits, expected, atol=1e-4, rtol=0)


def test_llava_folder_without_a_processor_exports_with_pixel_values(tmp_path):
    from hfexport.models.tiny import build_tiny

    model = build_tiny("llava")
    model.save_pretrained(tmp_path / "llava")
    result = run("export", tmp_path / "llava", "--out", tmp_path / "out")
    assert "task image-text-to-text" in result.stderr
    assert {"input_ids", "pixel_values"} <= set(program_inputs(tmp_path / "out"))


def test_minilm_from_the_cli_runs_in_plain_onnx_runtime_on_the_tokenizers_output(checkpoint, tmp_path):
    import onnxruntime

    folder = checkpoint("all-minilm-l6-v2")
    run("export", folder, "--format", "onnx", "--out", tmp_path / "out")
    assert "token_type_ids" in program_inputs(tmp_path / "out")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    session = onnxruntime.InferenceSession(str(tmp_path / "out" / "model.onnx"))
    questions = ["How old is the universe?", "Where is Paris?", "Why?"]
    passages = ["The universe is about 13.8 billion years old.", "Paris is in France, on the Seine.", "Because."]
    for encoded in (
        tokenizer(questions, passages, padding=True, return_tensors="np"),  # sentence pairs, padded
        tokenizer(questions[0], passages[0], return_tensors="np"),  # one pair
    ):
        assert encoded["token_type_ids"].any()  # the second segment is marked
        got = session.run(None, dict(encoded))[0]
        with torch.no_grad():
            expected = model(**{k: torch.from_numpy(v) for k, v in encoded.items()}).last_hidden_state
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-4, rtol=0)


def test_mamba_folder_exports_with_its_own_attention_free_layers(tmp_path):
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8)
    model = transformers.MambaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "mamba")
    run("export", tmp_path / "mamba", "--out", tmp_path / "out")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    program = load_exported_program(tmp_path / "out" / "model.pt2")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(program.module()(**inputs).logits, expected, atol=1e-4, rtol=0)


def test_gpt2_folder_exports_for_generation_and_generates_eagers_tokens(tmp_path):
    # GPT-2's forward takes token_type_ids, which the generation sample carried: the decode graph
    # came out taking exactly one query token and `generate` refused the folder
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:  # varied greedy tokens (the default init repeats one)
                parameter.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "gpt2")
    run("export", tmp_path / "gpt2", "--generation", "--out", tmp_path / "out", "--max-cache-len", "32")
    prompt = [5, 17, 33, 90, 41]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8)[0, 5:].tolist()
    assert len(set(expected)) >= 3, expected
    done = run("generate", tmp_path / "out", "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8")
    assert done.stdout.strip().splitlines()[0] == ",".join(map(str, expected))


REMOTE_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class ShoutConfig(LlamaConfig):
    model_type = "shout"


class ShoutForCausalLM(LlamaForCausalLM):
    config_class = ShoutConfig

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        outputs = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        outputs.logits = outputs.logits * 2
        return outputs
"""


def test_a_folder_with_its_own_model_code_needs_trust_remote_code(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "shout.py").write_text(textwrap.dedent(REMOTE_CODE))
    sys.path.insert(0, str(tmp_path / "code"))
    try:
        import shout

        shout.ShoutConfig.register_for_auto_class()
        shout.ShoutForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        torch.manual_seed(0)
        config = shout.ShoutConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
        model = shout.ShoutForCausalLM(config).eval()
        model.save_pretrained(tmp_path / "shout")
    finally:
        sys.path.remove(str(tmp_path / "code"))
    assert "auto_map" in json.loads((tmp_path / "shout" / "config.json").read_text())
    refused = run("export", tmp_path / "shout", "--out", tmp_path / "refused", check=False)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 2 and "--trust-remote-code" in lines[1]  # after "loading"
    run("export", tmp_path / "shout", "--out", tmp_path / "out", "--trust-remote-code")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    program = load_exported_program(tmp_path / "out" / "model.pt2")
    with torch.no_grad():
        expected = model(**inputs).logits  # the folder's own code: doubled logits
    torch.testing.assert_close(program.module()(**inputs).logits, expected, atol=1e-4, rtol=0)


def test_a_gguf_file_as_model(tmp_path):
    from hfexport.checkpoints import CHECKPOINTS, _package_folder

    checkpoint = CHECKPOINTS["smollm2-135m-instruct"]
    gguf = _package_folder(checkpoint) / checkpoint.gguf_file
    result = run(
        "export", gguf, "--out", tmp_path / "out", "--seq", "4", "--batch", "1", env={"HFEXPORT_CACHE": str(tmp_path)}
    )
    assert "task text-generation" in result.stderr
    assert (tmp_path / "out" / "model.pt2").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("Qwen/Qwen3-0.6B", "hfexport does not download from the Hub"),
        ("no-such-folder", "neither a preset"),
    ],
)
def test_a_model_that_is_not_on_disk_is_one_line(tmp_path, model, expected):
    result = run("export", model, "--out", tmp_path / "out", check=False)
    assert result.returncode == 2 and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2  # "loading ..." and the error


def test_a_static_export_prints_the_shapes_it_takes(tmp_path):
    result = run("export", "tiny-bert", "--static", "--out", tmp_path / "out")
    assert "static shapes: the program takes exactly input_ids [2, 8] int64" in result.stderr
    assert "token_type_ids" in program_inputs(tmp_path / "out")


def test_a_folder_whose_weights_do_not_fit_the_class_is_refused(tmp_path):
    """A checkpoint saved from a base BERT, exported for text classification: transformers
    initialises the classifier at random and only logs it, and the export carried those random
    weights silently (ShieldGemma 2's folders lost every weight that way and generated other tokens
    than their model)."""
    config = transformers.BertConfig(vocab_size=99, **TINY_VISION)
    transformers.BertModel(config).save_pretrained(tmp_path / "bert")
    result = run("export", tmp_path / "bert", "--task", "text-classification", "--out", tmp_path / "out", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "classifier.bias, classifier.weight" in error and "would be random" in error and "--task" in error
    assert not (tmp_path / "out").exists()
