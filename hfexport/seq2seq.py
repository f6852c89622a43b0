"""Generation with an encoder-decoder export (T5, Bart, Whisper, …): the backend-neutral loop over
the folder's three programs, each run by its target's runner with inputs and outputs named by
keyword path.

- ``encoder`` runs once on the tokenised prompt (``input_ids``) or the audio features
  (``input_features``, from the folder's feature extractor);
- ``prefill`` runs once on the decoder start token: of its outputs only the cross-attention
  cache (keys and values of the encoder states, as long as the source) is kept;
- ``decode`` takes the decoder prompt and then one token per step, with the static self-attention
  cache (fed and written back, or kept inside an ExecuTorch program as its state) and the
  cross-attention cache from the prefill.

The tokens are ``model.generate(do_sample=False)``'s: the decoder prompt (``decoder_start_token_id``,
and Whisper's forced language / task / no-timestamps tokens) and the logits processors of the
generation config that change greedy tokens (suppressed tokens, forced BOS / EOS, a minimum length)
are applied; a setting this loop does not implement is refused in one line.
"""

from __future__ import annotations

import json
import logging
import time
import wave
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.errors import HfExportError
from hfexport.generation import DecodeMasks, Generation, PromptInChunks, Sampling, TokenStream, greedy_decode

# generation-config settings that change greedy tokens and that this loop does not apply: refused
# (the default value of each is what it has when unset)
_UNSUPPORTED = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "force_words_ids": None,
    "constraints": None,
    "return_timestamps": None,
}

logger = logging.getLogger(__name__)

ENCODER_DECODER_COMPONENTS = ("encoder", "prefill", "decode")
SELF_ATTENTION = "cache.self_attention_cache."


def is_encoder_decoder_export(manifest: Any) -> bool:
    """Whether a manifest holds an encoder-decoder generation export (``encoder``, ``prefill`` and
    ``decode`` components)."""
    return bool(manifest.generation) and all(name in manifest.components for name in ENCODER_DECODER_COMPONENTS)


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """``(samples, sampling rate)`` of a PCM WAV file: float32 in [-1, 1], channels averaged to mono."""
    try:
        with wave.open(str(path), "rb") as file:
            width, channels, rate = file.getsampwidth(), file.getnchannels(), file.getframerate()
            frames = file.readframes(file.getnframes())
    except FileNotFoundError:
        raise
    except (wave.Error, EOFError) as error:
        raise HfExportError(f"{path} is not a PCM WAV file ({error}); convert it to 16-bit PCM WAV") from error
    kinds = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2147483648.0)}
    if width not in kinds:
        raise HfExportError(f"{path} has {8 * width}-bit samples; give 8-, 16- or 32-bit PCM WAV")
    kind, offset, scale = kinds[width]
    samples = (np.frombuffer(frames, dtype=kind).astype(np.float32) - offset) / scale
    return samples.reshape(-1, channels).mean(axis=1), rate


class EncoderDecoderGenerator:
    """Greedy generation from an encoder-decoder export folder written with ``--generation``:
    its ``encoder``, ``prefill`` and ``decode`` programs, and the config, generation config,
    tokenizer and feature extractor copied next to them. Use :func:`hfexport.load`."""

    def __init__(self, folder: str | Path, trust: bool = False) -> None:
        from hfexport.targets import ExportFolder

        self.folder = Path(folder)
        self.export = ExportFolder(self.folder, trust)
        if not is_encoder_decoder_export(self.export.manifest):
            raise HfExportError(f"{folder} is not an encoder-decoder generation export (encoder, prefill, decode)")
        self.encoder = self.export.runner("encoder")
        self.prefill = self.export.runner("prefill")
        self.decoder = self.export.runner("decode")
        self.config = self._json("config.json")
        self.generation_config = self._generation_config()
        self.tokenizer = self._tokenizer()
        self.feature_extractor = self._feature_extractor()
        self.eos_token_id = self._eos_token_ids()
        self._check_inputs()
        # transformers' EncoderDecoderCache: the decode steps write the self-attention cache and
        # read the cross-attention cache the prefill wrote
        decode = self.decoder.spec
        self.cache_specs = [i for i in decode.fed if i.path.startswith(SELF_ATTENTION)]
        held = [i.shape for i in decode.inputs if i.path.startswith(SELF_ATTENTION) and len(i.shape) == 4]
        if not held:
            raise HfExportError(
                f"the decode program in {folder} takes no static self-attention cache ({SELF_ATTENTION}*); export "
                "it with hfexport's --generation"
            )
        self.max_cache_len = max(shape[2] for shape in held)
        ids = next(i for i in decode.fed if i.path == "decoder_input_ids")
        self.query_dynamic = 1 in ids.dynamic

    # --- the folder's files ---

    def _json(self, name: str) -> dict[str, Any]:
        path = self.folder / name
        return json.loads(path.read_text()) if path.is_file() else {}

    def _generation_config(self) -> Any:
        from transformers import GenerationConfig

        if (self.folder / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(self.folder)
        if self.config:
            return GenerationConfig.from_model_config(_Config(self.config))
        return GenerationConfig()

    def _tokenizer(self) -> Any:
        if not (self.folder / "tokenizer_config.json").is_file() and not (self.folder / "tokenizer.json").is_file():
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)

    def _feature_extractor(self) -> Any:
        if not (self.folder / "preprocessor_config.json").is_file():
            return None
        from transformers import AutoFeatureExtractor

        return AutoFeatureExtractor.from_pretrained(self.folder)

    def _eos_token_ids(self) -> list[int]:
        eos = self.generation_config.eos_token_id
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return sorted(set(ids))

    def _check_inputs(self) -> None:
        """Refuse up front an input of the prefill or decode program this loop cannot feed."""
        for runner in (self.prefill, self.decoder):
            for spec in runner.spec.fed:
                if spec.path in ("decoder_input_ids", "attention_mask") or spec.path.startswith(
                    ("cache.", "encoder_outputs.")
                ):
                    continue
                if spec.path.split(".")[0] == "decoder_attention_mask" and len(spec.shape) == 4:
                    continue
                raise HfExportError(
                    f"the {'decode' if runner is self.decoder else 'prefill'} program in {self.folder} takes an input "
                    f"{spec.name!r} ({spec.dtype}, {len(spec.shape)}-D) that hfexport's encoder-decoder loop does "
                    "not feed; run the folder's programs yourself"
                )
        settings = self.generation_config
        beams = getattr(settings, "num_beams", 1) or 1
        if beams > 1:  # a translation checkpoint may ask for beams (FSMT: 5): decoded greedily, said once
            logger.warning(
                "the generation config in %s asks for beam search (num_beams=%d); hfexport's loop decodes greedily, "
                "as model.generate(num_beams=1) does",
                self.folder,
                beams,
            )
        for name, default in _UNSUPPORTED.items():
            value = getattr(settings, name, default)
            if value not in (default, None, False):
                raise HfExportError(
                    f"the generation config in {self.folder} sets {name}={value!r}, which hfexport's greedy "
                    "encoder-decoder loop does not apply; remove it from generation_config.json to generate "
                    "without it"
                )

    # --- inputs ---

    def encoder_inputs(self, prompt: str | Sequence[int] | None = None, audio: Any = None) -> dict[str, torch.Tensor]:
        """The encoder's inputs: from ``prompt`` (text through the tokenizer, or token ids), or
        from ``audio`` (a WAV path, or ``(samples, sampling rate)``) through the feature extractor."""
        names = {i.path for i in self.encoder.spec.fed}
        if "input_features" in names:
            if audio is None:
                raise HfExportError(
                    f"the encoder in {self.folder} takes audio features (input_features); give an audio file "
                    "(--audio FILE.wav, or audio= in Python), not a text prompt"
                )
            return self._audio_features(audio)
        if audio is not None:
            raise HfExportError(f"the encoder in {self.folder} takes {', '.join(sorted(names))}, not audio")
        if prompt is None:
            raise HfExportError("give a prompt (text or token ids)")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise HfExportError(
                    f"{self.folder} has no tokenizer files; export from a checkpoint folder that has them, "
                    "or pass token ids"
                )
            encoded = self.tokenizer(prompt, return_tensors="pt")
            ids, mask = encoded["input_ids"], encoded.get("attention_mask")
        else:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            vocab = self.config.get("vocab_size")
            beyond = [t for t in ids[0].tolist() if t < 0 or (isinstance(vocab, int) and t >= vocab)]
            if beyond:
                raise HfExportError(f"prompt token id(s) {beyond} are outside the vocabulary (0 to {vocab - 1})")
            mask = None
        if ids.shape[1] == 0:
            raise HfExportError("the prompt is empty")
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids) if mask is None else mask.long()}
        return {name: value for name, value in inputs.items() if name in names}

    def _audio_features(self, audio: Any) -> dict[str, torch.Tensor]:
        if self.feature_extractor is None:
            raise HfExportError(
                f"{self.folder} has no feature extractor (preprocessor_config.json); export from a checkpoint "
                "folder that has one"
            )
        samples, rate = read_wav(audio) if isinstance(audio, (str, Path)) else audio
        wanted = getattr(self.feature_extractor, "sampling_rate", rate)
        if rate != wanted:
            raise HfExportError(
                f"the audio is sampled at {rate} Hz and the feature extractor takes {wanted} Hz; resample it"
            )
        features = self.feature_extractor(
            np.asarray(samples, dtype=np.float32), sampling_rate=rate, return_tensors="pt"
        )
        return {"input_features": features["input_features"]}

    def decoder_prompt(self) -> list[int]:
        """The tokens ``generate`` starts the decoder with: ``decoder_start_token_id``, and for
        Whisper its forced language, task and no-timestamps tokens."""
        settings = self.generation_config
        start = settings.decoder_start_token_id
        if start is None:
            start = self.config.get("decoder_start_token_id")
        if start is None:  # generate's fallback too (a config key present as null is no start id)
            start = settings.bos_token_id
        if start is None:
            raise HfExportError(f"the configs in {self.folder} give no decoder_start_token_id")
        if isinstance(start, (list, tuple)):
            start = start[0]
        tokens = [int(start)]
        if self.config.get("model_type") != "whisper":
            return tokens
        language, task = getattr(settings, "language", None), getattr(settings, "task", None)
        forced = getattr(settings, "forced_decoder_ids", None) or self.config.get("forced_decoder_ids")
        if task is None and language is None and forced:
            for index, (position, token) in enumerate(forced, start=1):
                if position != index:
                    break
                tokens.append(token)
        lang_to_id = getattr(settings, "lang_to_id", None)
        if language is not None:
            key = language if language in (lang_to_id or {}) else f"<|{language}|>"
            if not lang_to_id or key not in lang_to_id:
                raise HfExportError(f"language {language!r} is not in the generation config's lang_to_id")
            tokens[1:2] = [lang_to_id[key]]
        elif lang_to_id and (len(tokens) < 2 or tokens[1] is None):
            raise HfExportError(
                "this Whisper checkpoint detects the language before transcribing, which hfexport's loop does not "
                'do; set "language" (e.g. "en") in the export folder\'s generation_config.json'
            )
        task_to_id = getattr(settings, "task_to_id", None)
        if task is not None:
            if not task_to_id or task not in task_to_id:
                raise HfExportError(f"task {task!r} is not in the generation config's task_to_id")
            tokens = [t for t in tokens if t not in task_to_id.values()] + [task_to_id[task]]
        elif language is not None and task_to_id and not any(t in tokens for t in task_to_id.values()):
            tokens.append(task_to_id["transcribe"])
        no_timestamps = getattr(settings, "no_timestamps_token_id", None)
        if no_timestamps is not None and tokens[-1] != no_timestamps:
            tokens.append(no_timestamps)
        return [t for t in tokens if t is not None]

    # --- running ---

    @staticmethod
    def _masks(runner: Any) -> Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
        """``(valid, query_slots) -> {path: mask}``: the decoder self-attention masks ``runner``'s
        program takes (none, one ``decoder_attention_mask``, or one per layer type: T5Gemma's
        sliding layers), in the dtype it was exported with."""
        specs = [i for i in runner.spec.fed if i.path.split(".")[0] == "decoder_attention_mask"]
        if not specs:
            return lambda valid, query_slots: {}
        dtypes = {i.path: getattr(torch, i.dtype) for i in specs if i.dtype not in ("", "bool")}
        return DecodeMasks.from_input_paths(
            [i.path for i in specs], runner.spec.attention_windows, dtypes, name="decoder_attention_mask"
        ).by_input_path

    def _shared(
        self, runner: Any, encoded: dict[str, torch.Tensor], states: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What the prefill and decode take from the encoder: its outputs (``encoder_outputs.<i>``:
        the encoder's ``i``-th output; a BERT encoder's pooled output follows its states) and its
        attention mask."""
        hidden = states["last_hidden_state"]
        ordered = list(states.values())
        fed: dict[str, torch.Tensor] = {}
        for spec in runner.spec.fed:
            if spec.path.startswith("encoder_outputs."):
                index = spec.path.split(".")[1]
                fed[spec.path] = ordered[int(index)] if index.isdigit() and int(index) < len(ordered) else hidden
            elif spec.path == "attention_mask":
                mask = encoded.get("attention_mask")
                fed[spec.path] = torch.ones(hidden.shape[:2], dtype=torch.long) if mask is None else mask
        return fed

    def start(self, encoded: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Run the encoder and the prefill on ``encoded`` and return the decode ``step`` for
        :func:`~hfexport.generation.greedy_decode` (a fresh self-attention cache)."""
        states = self.encoder.run_named(encoded)
        batch = states["last_hidden_state"].shape[0]
        valid = torch.zeros(batch, self.max_cache_len, dtype=torch.long)
        valid[:, 0] = 1
        start = torch.full((batch, 1), self.decoder_prompt()[0], dtype=torch.long)
        prefill = {"decoder_input_ids": start, **self._shared(self.prefill, encoded, states)}
        prefill.update(self._masks(self.prefill)(valid, torch.tensor([0])))
        for spec in self.prefill.spec.fed:
            if spec.path.startswith("cache."):  # an empty cache's token counters
                prefill[spec.path] = torch.zeros((), dtype=getattr(torch, spec.dtype or "int64"))
        produced = self.prefill.run_named(prefill)
        shared = self._shared(self.decoder, encoded, states)
        cache = {
            spec.path: torch.zeros([batch, *spec.shape[1:]] if spec.shape else [], dtype=getattr(torch, spec.dtype))
            for spec in self.cache_specs
        }
        missing = [
            i.path
            for i in self.decoder.spec.fed
            if i.path.startswith("cache.") and i.path not in cache and i.path not in produced
        ]
        if missing:
            raise HfExportError(
                f"the decode program in {self.folder} takes {missing[0]}, which the prefill does not produce; "
                "export the folder again with --generation"
            )
        cross = {
            i.path: produced[i.path]
            for i in self.decoder.spec.fed
            if i.path.startswith("cache.") and i.path not in cache
        }
        runner, masks = self.decoder, self._masks(self.decoder)

        def step(
            input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, positions: Any
        ) -> torch.Tensor:
            fed = {
                "decoder_input_ids": input_ids.contiguous(),
                **masks(valid, query_slots),
                **shared,
                **cross,
                **cache,
            }
            produced = runner.run_named(fed)
            for path in cache:
                cache[path] = produced[path]
            return produced["logits"]

        return step

    def generate_ids(
        self,
        encoded: dict[str, torch.Tensor],
        max_new_tokens: int | None = None,
        on_token: Callable[[torch.Tensor], None] | None = None,
        sampling: Sampling | None = None,
    ) -> torch.Tensor:
        """``[batch, decoder prompt + new]`` token ids from the encoder inputs ``encoded``, as
        ``model.generate(**encoded, do_sample=False, max_new_tokens=...)`` gives them
        (``None``: until EOS or the static cache is full); drawn as ``sampling`` says, if given."""
        prompt = self.decoder_prompt()
        room = self.max_cache_len - len(prompt)
        if max_new_tokens is None:
            max_new_tokens = room
        if max_new_tokens > room:
            raise HfExportError(
                f"the decoder prompt ({len(prompt)} tokens) and {max_new_tokens} new tokens exceed the export's cache "
                f"({self.max_cache_len} tokens); ask for fewer or export again with a larger --max-cache-len"
            )
        batch = next(iter(encoded.values())).shape[0]
        step = _Processed(
            self.start(encoded), self, len(prompt), len(prompt) + max_new_tokens, encoded.get("input_ids")
        )
        prompt_ids = torch.tensor([prompt] * batch, dtype=torch.long)
        if not self.query_dynamic:
            step = PromptInChunks(step)
        pad = self.generation_config.pad_token_id
        return greedy_decode(
            step,
            prompt_ids,
            max_new_tokens,
            self.max_cache_len,
            eos_token_id=self.eos_token_id or None,
            pad_token_id=0 if pad is None else int(pad),
            on_token=on_token,
            sampling=sampling,
        )

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        max_new_tokens: int | None = None,
        chat: bool = False,
        stream: Callable[[str], None] | None = None,
        audio: Any = None,
        sampling: Sampling | None = None,
    ) -> Generation:
        """Generation from a text prompt (or token ids), or from ``audio`` (a WAV path or
        ``(samples, sampling rate)``) for a speech model: the new tokens after the decoder prompt,
        their text (with a tokenizer), and the speed figures, as
        :meth:`~hfexport.text_generator.TextGenerator.generate` (greedy unless ``sampling``)."""
        if chat:
            raise HfExportError(
                "--chat applies a decoder-only model's chat template; an encoder-decoder takes the text"
            )
        started = time.perf_counter()
        encoded = self.encoder_inputs(prompt, audio)
        tokens = TokenStream(self.tokenizer, stream)
        room = self.max_cache_len - len(self.decoder_prompt())
        self.generate_ids(encoded, max_new_tokens, tokens, sampling)
        prompt_tokens = int(encoded["input_ids"].shape[1]) if "input_ids" in encoded else 0
        cache_full = len(tokens.tokens) == room and max_new_tokens is None
        return tokens.generation(prompt_tokens, started, self.eos_token_id, cache_full)


class _Config:
    """A config dict seen as the attributes ``GenerationConfig.from_model_config`` reads."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def get_text_config(self, decoder: bool = False) -> _Config:
        return self


class _Processed:
    """A decode ``step`` whose last logits go through the generation config's processors that
    change greedy tokens, as transformers applies them: suppressed tokens, suppressed at the first
    new token (``begin_suppress_tokens``), forced BOS after the start token, forced EOS at the last
    token, no EOS before ``min_new_tokens`` / ``min_length``, and no n-gram repeated from the
    decoder's tokens (``no_repeat_ngram_size``) or taken from the encoder's input ids
    (``encoder_no_repeat_ngram_size``, BlenderBot's). It sees the tokens it is fed."""

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        owner: EncoderDecoderGenerator,
        begin: int,
        max_length: int,
        encoder_ids: torch.Tensor | None = None,
    ):
        settings = owner.generation_config
        self.step, self.begin, self.max_length = step, begin, max_length
        self.length = 0
        self.history: torch.Tensor | None = None  # the decoder tokens fed so far, [batch, length]
        self.repeat = settings.no_repeat_ngram_size or 0
        self.encoder_repeat = settings.encoder_no_repeat_ngram_size or 0
        self.encoder_ngrams = (
            [_ngrams(row.tolist(), self.encoder_repeat) for row in encoder_ids]
            if self.encoder_repeat and encoder_ids is not None
            else None
        )
        self.suppress = list(settings.suppress_tokens or [])
        self.begin_suppress = list(settings.begin_suppress_tokens or [])
        self.forced_bos = settings.forced_bos_token_id
        self.forced_eos = settings.forced_eos_token_id
        self.eos = owner.eos_token_id
        min_new = settings.min_new_tokens
        self.min_length = begin + min_new if min_new else (settings.min_length or 0)

    def __call__(self, input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        logits = self.step(input_ids, *args)
        self.length += input_ids.shape[1]
        self.history = input_ids if self.history is None else torch.cat([self.history, input_ids], dim=1)
        last = logits[:, -1:].clone()
        scores = last[:, 0]
        lowest = torch.finfo(scores.dtype).min if scores.is_floating_point() else -(2**31)
        for row, sequence in enumerate(self.history.tolist()):
            banned: list[int] = []
            if self.repeat and len(sequence) >= self.repeat:
                banned += _ngrams(sequence, self.repeat).get(tuple(sequence[1 - self.repeat :]), [])
            if self.encoder_ngrams is not None:
                key = tuple(sequence[len(sequence) + 1 - self.encoder_repeat :])
                banned += self.encoder_ngrams[row].get(key, [])
            scores[row, _in_vocabulary(banned, scores)] = lowest
        if self.length < self.min_length and self.eos:
            scores[:, self.eos] = lowest
        if self.forced_bos is not None and self.length == 1:
            scores[:] = lowest
            scores[:, self.forced_bos] = 0
        if self.forced_eos is not None and self.length == self.max_length - 1:
            forced = [self.forced_eos] if isinstance(self.forced_eos, int) else list(self.forced_eos)
            scores[:] = lowest
            scores[:, forced] = 0
        if self.suppress:
            scores[:, _in_vocabulary(self.suppress, scores)] = lowest
        if self.begin_suppress and self.length == self.begin:
            scores[:, _in_vocabulary(self.begin_suppress, scores)] = lowest
        return last


def _ngrams(tokens: list[int], size: int) -> dict[tuple[int, ...], list[int]]:
    """``{first size-1 tokens: the tokens that followed them}`` over every n-gram of ``tokens``."""
    found: dict[tuple[int, ...], list[int]] = {}
    for start in range(len(tokens) - size + 1):
        found.setdefault(tuple(tokens[start : start + size - 1]), []).append(tokens[start + size - 1])
    return found


def _in_vocabulary(tokens: list[int], scores: torch.Tensor) -> list[int]:
    """The ids of ``tokens`` that have a score: transformers' suppressing processors match ids
    against the vocabulary, so an id beyond it (a config shared by checkpoints of several
    vocabulary sizes) suppresses nothing."""
    return [token for token in tokens if 0 <= token < scores.shape[-1]]
