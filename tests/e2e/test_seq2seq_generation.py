"""Encoder-decoder generation end to end: a tiny T5, Bart and Whisper saved as checkpoint folders
(with a tokenizer, or a feature extractor), exported from the command line with ``--generation``
to every target from one capture, then ``hfexport generate`` (``--prompt`` text, ``--audio`` WAV)
and ``hfexport.load(DIR).generate(...)`` give ``model.generate(do_sample=False)``'s tokens."""

import subprocess
import sys
import wave

import numpy as np
import pytest
import torch
from models import build_encoder_decoder

import hfexport

TARGETS = ["dynamo", "onnx", "executorch"]
NEW_TOKENS = 10
PROMPT = "w5 w17 w33 w90 w41 w7"
# weights redrawn at a scale so the tiny random models answer with varied tokens (their default
# initialisation repeats one token, which would compare little)
# (scale, seed), each checked to give varied tokens
WEIGHTS = {"t5": (0.5, 2), "bart": (1.0, 3), "whisper": (1.0, 2)}
KINDS = ["t5", "bart", "whisper"]
# Whisper: <|notimestamps|> after its start token, suppressed tokens everywhere and at the first one
WHISPER_GENERATION = {"no_timestamps_token_id": 3, "suppress_tokens": [5, 9], "begin_suppress_tokens": [72]}
RATE = 16000


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hfexport.cli", *args], capture_output=True, text=True, timeout=900)


def _tokenizer(model):
    """A word-level tokenizer over the tiny vocabulary (``w3`` … ``w127``) with the model's special ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = model.config
    special = {config.pad_token_id: "<pad>", config.eos_token_id: "</s>"}
    if getattr(config, "bos_token_id", None) is not None:
        special.setdefault(config.bos_token_id, "<s>")
    vocab = {special.get(i, f"w{i}"): i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<pad>")


def _write_wav(path, rate, seconds=0.8):
    t = np.arange(int(rate * seconds)) / rate
    signal = 0.4 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.random.default_rng(0).standard_normal(t.shape)
    with wave.open(str(path), "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((np.clip(signal, -1, 1) * 32767).astype(np.int16).tobytes())


def _read_wav(path):
    with wave.open(str(path), "rb") as file:
        return np.frombuffer(file.readframes(file.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0


def _checkpoint(kind, root):
    """A tiny ``kind`` saved with its tokenizer or feature extractor: ``(folder, extra)``."""
    model, _ = build_encoder_decoder(kind)
    scale, seed = WEIGHTS[kind]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    checkpoint = root / "checkpoint"
    extra = {}
    if kind == "whisper":
        from transformers import WhisperFeatureExtractor

        for key, value in WHISPER_GENERATION.items():
            setattr(model.generation_config, key, value)
        # 16 mel bins over 64 frames of one second: what the tiny encoder takes (2 x max_source_positions)
        extractor = WhisperFeatureExtractor(
            feature_size=16, sampling_rate=RATE, hop_length=250, chunk_length=1, n_fft=400
        )
        extractor.save_pretrained(checkpoint)
        extra["extractor"] = extractor
        _write_wav(root / "speech.wav", RATE)
        extra["wav"] = root / "speech.wav"
    else:
        extra["tokenizer"] = _tokenizer(model)
        extra["tokenizer"].save_pretrained(checkpoint)
    model.save_pretrained(checkpoint)
    return checkpoint, extra


_CHECKPOINTS = {}


def _export(kind, targets, tmp_path_factory):
    """``(kind, checkpoint folder, {target: export folder}, extra)``: one command-line export (one
    capture) to ``targets``."""
    if kind not in _CHECKPOINTS:
        _CHECKPOINTS[kind] = _checkpoint(kind, tmp_path_factory.mktemp(kind))
    checkpoint, extra = _CHECKPOINTS[kind]
    out = tmp_path_factory.mktemp(f"{kind}-export")
    done = _cli(
        "export",
        str(checkpoint),
        "--generation",
        "--format",
        ",".join(targets),
        "--out",
        str(out),
        "--max-cache-len",
        "32",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folders = {target: out / target for target in targets} if len(targets) > 1 else {targets[0]: out}
    return kind, checkpoint, folders, extra


@pytest.fixture(scope="module", params=KINDS)
def exported(request, tmp_path_factory):
    """Each kind exported to Dynamo and ONNX from one capture."""
    return _export(request.param, ["dynamo", "onnx"], tmp_path_factory)


@pytest.fixture(scope="module")
def exported_executorch(tmp_path_factory):
    """``{kind: export}`` to ExecuTorch, made on first use (its lowering takes about a minute a kind)."""
    made = {}

    def get(kind):
        if kind not in made:
            made[kind] = _export(kind, ["executorch"], tmp_path_factory)
        return made[kind]

    return get


def _reference(kind, checkpoint, extra):
    """model.generate's new tokens (after the decoder prompt), the model loaded from ``checkpoint``
    as a user would (its generation config read back from the folder)."""
    import transformers

    model_class = (
        transformers.WhisperForConditionalGeneration if kind == "whisper" else transformers.AutoModelForSeq2SeqLM
    )
    model = model_class.from_pretrained(checkpoint).eval()
    if kind == "whisper":
        features = extra["extractor"](_read_wav(extra["wav"]), sampling_rate=RATE, return_tensors="pt")
        inputs = {"input_features": features["input_features"]}
    else:
        inputs = dict(extra["tokenizer"](PROMPT, return_tensors="pt"))
    with torch.no_grad():
        sequences = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
    # Whisper's generate returns the new tokens only; the others start with the decoder start token
    return sequences[0].tolist() if kind == "whisper" else sequences[0, 1:].tolist()


def _check_generation(kind, checkpoint, folder, extra):
    expected = _reference(kind, checkpoint, extra)
    assert len(set(expected)) >= 3, expected  # the comparison is not one repeated token

    # Python: hfexport.load, no trust needed (hfexport's own .pt2 holds no pickled objects)
    generator = hfexport.load(folder)
    if kind == "whisper":
        got = generator.generate(audio=str(extra["wav"]), max_new_tokens=NEW_TOKENS)
    else:
        got = generator.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    # generate pads the rest of a finished sequence; hfexport stops at its EOS
    assert got.tokens == expected[: len(got.tokens)], (got.tokens, expected)
    assert len(got.tokens) == len(expected) or got.stop == "end of sequence", (got.tokens, expected)

    # the command line: token ids (and text with a tokenizer)
    if kind == "whisper":
        done = _cli("generate", str(folder), "--audio", str(extra["wav"]), "--max-new-tokens", str(NEW_TOKENS))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[0] == ",".join(map(str, got.tokens))
    else:
        done = _cli("generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS))
        assert done.returncode == 0, done.stderr[-2000:]
        text = extra["tokenizer"].decode(expected, skip_special_tokens=True)
        assert done.stdout.strip() == text.strip() and text.strip()


@pytest.mark.parametrize("target", ["dynamo", "onnx"])
def test_generate_gives_model_generate_tokens(exported, target):
    kind, checkpoint, folders, extra = exported
    _check_generation(kind, checkpoint, folders[target], extra)


# ExecuTorch lowers each kind in about a minute (two on a loaded host): T5 runs in make test, Bart
# and Whisper in make test-all, to keep make test under 30 minutes
@pytest.mark.parametrize(
    "kind", ["t5", pytest.param("bart", marks=pytest.mark.slow), pytest.param("whisper", marks=pytest.mark.slow)]
)
def test_executorch_generate_gives_model_generate_tokens(exported_executorch, kind):
    _, checkpoint, folders, extra = exported_executorch(kind)
    _check_generation(kind, checkpoint, folders["executorch"], extra)


def test_wrong_input_kind_is_one_line(exported):
    kind, _, folders, _ = exported
    if kind == "whisper":
        done = _cli("generate", str(folders["dynamo"]), "--prompt", "hello")
        assert "give an audio file" in done.stderr
    else:
        done = _cli("generate", str(folders["dynamo"]), "--audio", str(folders["dynamo"] / "hfexport.json"))
        assert "not audio" in done.stderr
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_executorch_encoder_decoder_takes_a_prompt_longer_than_its_cache(exported_executorch):
    # the cache holds the decoder's tokens; the encoder's states and mask are as long as the prompt.
    # The decoder programs were bounded by the cache length (32), so a 40-word prompt failed there
    _, checkpoint, folders, extra = exported_executorch("t5")
    import transformers

    prompt = " ".join(f"w{3 + (7 * i) % 120}" for i in range(40))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        expected = model.generate(**extra["tokenizer"](prompt, return_tensors="pt"), do_sample=False, max_new_tokens=6)
    got = hfexport.load(folders["executorch"]).generate(prompt, max_new_tokens=6)
    assert got.tokens == expected[0, 1:].tolist()[: len(got.tokens)]


def test_suppressed_token_ids_beyond_the_vocabulary_suppress_nothing():
    # transformers matches suppressed ids against the vocabulary; a Whisper config lists 50256
    # for every vocabulary size, which raised an IndexError in the decode loop
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hfexport.seq2seq import _Processed

    settings = GenerationConfig(suppress_tokens=[2, 50256], begin_suppress_tokens=[3, 50257])
    owner = SimpleNamespace(generation_config=settings, eos_token_id=[])
    logits = torch.zeros(1, 1, 8)
    step = _Processed(lambda ids, *rest: logits, owner, begin=1, max_length=10)
    scores = step(torch.tensor([[0]]))[0, -1]
    assert scores[2] == scores[3] == torch.finfo(scores.dtype).min
    assert (scores[[0, 1, 4, 5, 6, 7]] == 0).all()


def test_repeated_ngrams_are_banned_as_transformers_bans_them():
    # BlenderBot's generation config sets encoder_no_repeat_ngram_size=3, which the loop refused:
    # its folders did not generate. Each step's bans equal transformers' own processors'
    from types import SimpleNamespace

    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        EncoderNoRepeatNGramLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
    )

    from hfexport.seq2seq import _Processed

    rows = torch.Generator().manual_seed(0)
    encoder_ids = torch.randint(0, 6, (2, 12), generator=rows)
    tokens = torch.randint(0, 6, (2, 14), generator=rows)  # few ids: n-grams repeat
    for repeat, encoder_repeat in [(2, 0), (0, 3), (3, 2)]:
        settings = GenerationConfig(no_repeat_ngram_size=repeat, encoder_no_repeat_ngram_size=encoder_repeat)
        owner = SimpleNamespace(generation_config=settings, eos_token_id=[])
        step = _Processed(lambda ids, *rest: torch.zeros(2, ids.shape[1], 8), owner, 1, 30, encoder_ids)
        processors = [NoRepeatNGramLogitsProcessor(repeat)] if repeat else []
        processors += [EncoderNoRepeatNGramLogitsProcessor(encoder_repeat, encoder_ids)] if encoder_repeat else []
        banned_any = False
        for end in range(1, tokens.shape[1] + 1):
            fed = tokens[:, :1] if end == 1 else tokens[:, end - 1 : end]
            got = step(fed)[:, -1]
            expected = torch.zeros(2, 8)
            for processor in processors:
                expected = processor(tokens[:, :end], expected)
            assert torch.equal(got == torch.finfo(got.dtype).min, expected == -float("inf")), (repeat, end)
            banned_any |= bool((expected == -float("inf")).any())
        assert banned_any, (repeat, encoder_repeat)


def test_a_beam_search_config_is_decoded_greedily_and_says_so(exported, tmp_path, caplog):
    # FSMT's checkpoints ask for five beams: hfexport's greedy loop gave other tokens than
    # model.generate without a word (and the export recorded five rows per prompt)
    import json
    import shutil

    kind, checkpoint, folders, extra = exported
    if kind == "whisper":
        pytest.skip("the text prompt kinds are enough: the loop is the same")
    folder = shutil.copytree(folders["dynamo"], tmp_path / "beams")
    settings = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**settings, "num_beams": 4}))
    with caplog.at_level("WARNING", logger="hfexport.seq2seq"):
        got = hfexport.load(folder).generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert "asks for beam search (num_beams=4)" in caplog.text
    expected = _reference(kind, checkpoint, extra)
    assert got.tokens == expected[: len(got.tokens)]
