"""ExecuTorch's LLM runner (``TextLLMRunner`` from the executorch wheel, the real runtime, in a
subprocess: a wrong program aborts it) runs the ``.pte`` a decoder-only ``hfexport export
--format executorch --generation`` writes, with the tokenizer beside it, giving eager's text;
hfexport's own loop runs the same file token-exact with ``model.generate``."""

import subprocess
import sys

import pytest
import torch
from models import build
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfexport import ExportFolder
from hfexport.cli import main
from hfexport.generation import greedy_decode

# The runner prints each piece to stdout as it comes, as raw bytes. Its Python binding's
# ``token_callback`` cannot be used here: it hands each piece over as ``str``, and a piece holding
# part of a multi-byte character (Qwen3's random weights pick them) aborts ``generate`` with a
# UnicodeDecodeError in pybind11's string conversion.
RUN_TEXT_LLM_RUNNER = """
import ctypes, sys
import executorch.extension.llm.custom_ops.custom_ops  # registers llama::custom_sdpa, as the runner's build has it
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

pte, tokenizer, prompt, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
runner = TextLLMRunner(pte, tokenizer)
sys.stdout.write("<<pieces>>")
sys.stdout.flush()
runner.generate(prompt, GenerationConfig(temperature=0.0, echo=False, max_new_tokens=new))
ctypes.CDLL(None).fflush(None)  # the runner's C stdio buffer, before Python's own
sys.stdout.write("<<end>>")
"""


def text_llm_runner(pte, tokenizer, prompt: str, new_tokens: int) -> str:
    """``TextLLMRunner``'s greedy text for ``prompt``: the pieces it printed, decoded as one (a
    character split between two tokens decodes as transformers' ``decode`` does)."""
    done = subprocess.run(
        [sys.executable, "-c", RUN_TEXT_LLM_RUNNER, str(pte), str(tokenizer), prompt, str(new_tokens)],
        capture_output=True,
        timeout=600,
    )
    printed = done.stdout.partition(b"<<pieces>>")[2].partition(b"<<end>>")[0]
    assert done.returncode == 0 and b"\nPyTorchObserver " in printed, done.stderr[-2000:]
    # after the pieces the runner prints a newline, then its statistics line on a line of its own
    return printed.rpartition(b"\nPyTorchObserver ")[0].removesuffix(b"\n").decode(errors="replace")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint("smollm2-135m-instruct"))


def tiny_with_tokenizer(preset: str, tokenizer, folder) -> torch.nn.Module:
    """A tiny random ``preset`` over SmolLM2's tokenizer (the runner samples over the tokenizer's
    vocabulary), saved with it in ``folder`` as a checkpoint."""
    ids = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model = build(preset, vocab_size=len(tokenizer), **ids)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


# Gemma3: a sliding window of 4, which the 16 new tokens leave behind, and full-attention layers
# (Llama and Qwen3 in make test-all: an ExecuTorch export of each takes a minute here)
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "preset", [pytest.param("tiny-llama", marks=SLOW), pytest.param("tiny-qwen3", marks=SLOW), "tiny-gemma3"]
)
def test_a_generation_program_runs_in_executorch_s_llm_runner_and_in_hfexport(preset, tokenizer, tmp_path):
    from executorch.runtime import Runtime

    model = tiny_with_tokenizer(preset, tokenizer, tmp_path / "model")
    out = tmp_path / "out"
    export = ["export", str(tmp_path / "model"), "--format", "executorch", "--generation", "--max-cache-len", "64"]
    assert main([*export, "--out", str(out)]) == 0
    pte = out / ExportFolder(out).manifest.component("decode").file

    program = Runtime.get().load_program(pte)
    method = program.load_method("forward").metadata
    assert (method.num_inputs(), method.num_outputs()) == (2, 1)  # tokens, input_pos -> logits
    constants = {name: program.load_method(name).execute([]) for name in program.method_names - {"forward"}}
    assert constants["get_max_seq_len"] == [64] and constants["get_eos_ids"] == [tokenizer.eos_token_id]
    assert constants["enable_dynamic_shape"] == [True] and constants["use_kv_cache"] == [True]
    assert constants["get_vocab_size"] == [len(tokenizer)]

    prompt = "The quick brown fox jumps over the"
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=16, do_sample=False, cache_implementation="static")
    assert text_llm_runner(pte, out / "tokenizer.json", prompt, 16) == tokenizer.decode(reference[0, ids.shape[1] :])

    step = ExportFolder(out).decoder(batch_size=1)
    eos = tokenizer.eos_token_id
    assert torch.equal(greedy_decode(step, ids, 16, step.max_cache_len, eos_token_id=eos), reference)


@pytest.mark.slow  # an ExecuTorch export; the command line's fallback to it is in make test (test_coverage_generation)
def test_spec_io_keeps_the_spec_interface(tmp_path):
    out = tmp_path / "out"
    export = ["export", "tiny-llama", "--format", "executorch", "--generation", "--max-cache-len", "32"]
    assert main([*export, "--spec-io", "--out", str(out)]) == 0
    spec = ExportFolder(out).manifest.component("decode")
    assert spec.interface == "" and any(i.path.startswith("attention_mask") for i in spec.fed)


@pytest.mark.slow  # the 135M model's ExecuTorch export: about 2 minutes each here
@pytest.mark.parametrize("quantize", [None, "8da4w"])
def test_smollm2_runs_in_executorch_s_llm_runner(checkpoint, tmp_path, quantize):
    folder = checkpoint("smollm2-135m-instruct")
    out = tmp_path / "out"
    export = ["export", str(folder), "--format", "executorch", "--generation", "--max-cache-len", "128"]
    assert main([*export, *(["--quantize", quantize] if quantize else []), "--out", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reply = text_llm_runner(out / "model.pte", out / "tokenizer.json", text, 32)
    if quantize:
        assert "Paris" in reply, reply
        return
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    assert reply == tokenizer.decode(reference)
