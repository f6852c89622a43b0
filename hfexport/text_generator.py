"""Greedy text generation from an export folder written with ``--generation``: :func:`load` opens
the folder (any target) and gives a :class:`TextGenerator` for a decoder-only model, or an
:class:`~hfexport.seq2seq.EncoderDecoderGenerator` for an encoder-decoder one. This is the text
front end (tokenizer, chat template, EOS, streaming, speed figures) over the target's decoder
(:mod:`hfexport.targets`) and the backend-neutral decode loop (:mod:`hfexport.generation`), which
the targets' decoders build on; it sits above both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hfexport.errors import HfExportError
from hfexport.generation import Generation, Sampling, TokenStream, greedy_decode
from hfexport.seq2seq import EncoderDecoderGenerator, is_encoder_decoder_export
from hfexport.targets import ExportFolder
from hfexport.targets.manifest import Manifest


class TextGenerator:
    """Greedy text generation from an export folder written with ``--generation``: its decode
    program, and the tokenizer and generation config copied next to it (an export of a checkpoint
    folder has them). Use :func:`hfexport.load`."""

    def __init__(self, folder: str | Path, trust: bool = False) -> None:
        self.folder = Path(folder)
        self.export = ExportFolder(self.folder, trust)
        if not self.export.manifest.generation:
            raise HfExportError(
                f"{folder} holds a single-graph export; export with "
                "`hfexport export MODEL --generation --out DIR` to generate"
            )
        self.decoder = self.export.decoder(batch_size=1)
        self.tokenizer = self._tokenizer()
        self.eos_token_id = self._eos_token_ids()

    def _tokenizer(self) -> Any:
        if not (self.folder / "tokenizer_config.json").is_file() and not (self.folder / "tokenizer.json").is_file():
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)

    def _vocab_size(self) -> int | None:
        """The model config's vocabulary size, when the export folder has its ``config.json``."""
        path = self.folder / "config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
        return size if isinstance(size, int) else None

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        if (self.folder / "generation_config.json").is_file():
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(self.folder).eos_token_id
            ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> torch.Tensor:
        """``[1, length]`` prompt ids: ``prompt`` itself when it is ids, else tokenised (with the
        chat template when ``chat``)."""
        if not isinstance(prompt, str):
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            self._check_in_vocabulary(ids, "prompt token id(s) {} are outside the model's vocabulary ({})")
            return ids
        if self.tokenizer is None:
            raise HfExportError(
                f"{self.folder} has no tokenizer files; export from a checkpoint folder that has them, "
                "or pass token ids"
            )
        if chat:
            if not self.tokenizer.chat_template:
                raise HfExportError(f"the tokenizer in {self.folder} has no chat template; drop --chat")
            messages = [{"role": "user", "content": prompt}]
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            ids = encoded["input_ids"]
        else:
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        self._check_in_vocabulary(
            ids,
            f"the tokenizer in {self.folder} gives token id(s) {{}} outside the model's vocabulary ({{}}): "
            "it is not the model's tokenizer",
        )
        return ids

    def _check_in_vocabulary(self, ids: torch.Tensor, message: str) -> None:
        vocab = self._vocab_size()
        beyond = sorted({int(token) for token in ids.flatten() if token < 0 or (vocab is not None and token >= vocab)})
        if beyond:
            limit = f"0 to {vocab - 1}" if vocab is not None else "non-negative"
            raise HfExportError(message.format(beyond[:8], limit))

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int | None = None,
        chat: bool = False,
        stream: Callable[[str], None] | None = None,
        audio: Any = None,
        sampling: Sampling | None = None,
    ) -> Generation:
        """Generation until an EOS token or ``max_new_tokens`` (``None``: until the static cache
        is full), greedy unless ``sampling`` (a :class:`~hfexport.generation.Sampling`) says
        otherwise; ``stream(text)`` receives the decoded text piece by piece as tokens come (needs
        the tokenizer). ``audio`` is refused: a decoder-only export takes text."""
        if audio is not None:
            raise HfExportError(f"{self.folder} holds a decoder-only text model, which takes no audio; give a prompt")
        prompt_ids = self.encode(prompt, chat)
        room = self.decoder.max_cache_len - prompt_ids.shape[1]
        if max_new_tokens is None:
            if room < 1:
                raise HfExportError(
                    f"the prompt ({prompt_ids.shape[1]} tokens) fills the export's whole cache "
                    f"({self.decoder.max_cache_len} tokens); export again with a larger --max-cache-len"
                )
            max_new_tokens = room
        tokens = TokenStream(self.tokenizer, stream)
        started = time.perf_counter()
        greedy_decode(
            self.decoder,
            prompt_ids,
            max_new_tokens,
            self.decoder.max_cache_len,
            eos_token_id=self.eos_token_id or None,
            on_token=tokens,
            sampling=sampling,
        )
        return tokens.generation(prompt_ids.shape[1], started, self.eos_token_id, cache_full=len(tokens.tokens) == room)


def load(folder: str | Path, trust: bool = False) -> Any:
    """Open an export folder written with ``--generation`` (any target) for generation:
    ``hfexport.load(DIR).generate("What is the capital of France?", chat=True).text``. A decoder-only
    export gives a :class:`TextGenerator`; an encoder-decoder one (T5, Bart, Whisper: ``encoder``,
    ``prefill`` and ``decode`` programs) an :class:`~hfexport.seq2seq.EncoderDecoderGenerator`,
    whose ``generate`` also takes ``audio=`` (a WAV path) for a speech model.
    ``trust=True`` allows a program that runs code from its file when loaded (see
    :func:`~hfexport.load_exported_program`); hfexport's own exports never need it."""
    if is_encoder_decoder_export(Manifest.read(folder)):
        return EncoderDecoderGenerator(folder, trust)
    return TextGenerator(folder, trust)
