"""Sample inputs made by a checkpoint folder's own processors: its tokenizer, image processor,
feature extractor or multimodal processor. They give the inputs in the names, shapes and dtypes
the model is fed in use (``token_type_ids``, ``pixel_values``, ``input_features``, a padded
batch), which a sample made up from the config alone can only guess."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.models.tasks import TEXT_PAIR_TASKS

logger = logging.getLogger("hfexport")

# a padded batch: sentences of different lengths (cycled for larger batches)
SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Hello, world!",
    "Exporting models should be easy.",
)
# the inputs holding an image or a sound rather than text
MEDIA_INPUTS = frozenset({"pixel_values", "pixel_mask", "flattened_patches", "input_features", "input_values"})
SAMPLE_PAIRS = ("Is the fox quick?", "Who says hello?", "Is it easy?")


def sample_inputs_for(
    model: torch.nn.Module,
    folder: Path | None,
    task: str,
    batch: int = 2,
    seq: int = 8,
    seed: int = 0,
    generation: bool = False,
) -> dict[str, Any]:
    """The sample an export traces: made by the folder's processors where it has them
    (:func:`processor_sample_inputs`), else from the model's config
    (:func:`hfexport.models.samples.config_sample_inputs`); inputs no processor makes (an
    encoder-decoder's ``decoder_input_ids``) come from the config too. A single-graph sample of a
    model with multimodal rotary positions carries them (:func:`with_rope_positions`).

    ``generation``: the prompt ``--generation`` runs ``generate`` on once. A text-only model's is
    from the config (random ids and an unpadded mask, plus an encoder-decoder's ``decoder_*``
    inputs), without the inputs the decode loops never feed (GPT-2's optional ``token_type_ids``,
    which would fix the decode graph's query length at one token); generate computes the
    positions itself."""
    from hfexport.models.samples import config_sample_inputs, with_rope_positions

    from_config = config_sample_inputs(model, batch=batch, seq=seq, seed=seed)
    text_only = not (MEDIA_INPUTS & set(from_config))
    if generation and text_only:
        prompt = ("input_ids", "attention_mask")
        return {name: value for name, value in from_config.items() if name in prompt or name.startswith("decoder_")}
    made = processor_sample_inputs(model, folder, task, batch, seq, seed) if folder is not None else None
    if made is not None:
        # what no processor in the folder makes comes from the config: an encoder-decoder's decoder
        # inputs, and the image or audio of a folder with no processor for it (UDOP's page image
        # beside its tokenizer's words and boxes; a processor's image keeps its own mask)
        media = set() if MEDIA_INPUTS & set(made) else MEDIA_INPUTS
        unmade = {name for name in from_config if name.startswith("decoder_") or name in media} - set(made)
        made = {**made, **{name: from_config[name] for name in unmade}}
    inputs = from_config if made is None else made
    return inputs if generation else with_rope_positions(model, inputs)


def processor_sample_inputs(
    model: torch.nn.Module, folder: Path, task: str, batch: int = 2, seq: int = 8, seed: int = 0
) -> dict[str, Any] | None:
    """Sample inputs of ``batch`` rows from the processors saved in ``folder``, for the inputs the
    model's forward takes (text padded or cut to ``seq`` tokens, images, one second of audio);
    ``None`` when the folder has no processor for the model's main inputs. Inputs no processor
    makes (an encoder-decoder's ``decoder_input_ids``) are left to the caller."""
    parameters = set(inspect.signature(model.forward).parameters)
    generator = np.random.default_rng(seed)
    wants_text = "input_ids" in parameters
    wants_image = "pixel_values" in parameters
    wants_audio = bool({"input_features", "input_values"} & parameters)
    tokenizer = _load("AutoTokenizer", folder) if wants_text else None
    if wants_text and wants_image and tokenizer is not None and _has_image_placeholder(model):
        processor = _load("AutoProcessor", folder)
        if processor is None or getattr(processor, "image_token", None) is None:
            return None
        images = [_image(generator) for _ in range(batch)]
        texts = [f"{processor.image_token} {SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]}" for i in range(batch)]
        return _tensors(processor(text=texts, images=images, padding=True, return_tensors="pt"))
    inputs: dict[str, Any] = {}
    if wants_text and tokenizer is not None:
        inputs.update(_text(tokenizer, task, batch, seq))
    if wants_image:
        image_processor = _load("AutoImageProcessor", folder)
        if image_processor is not None:
            images = [_image(generator) for _ in range(batch)]
            inputs.update({"pixel_values": image_processor(images, return_tensors="pt")["pixel_values"]})
    if wants_audio:
        extractor = _load("AutoFeatureExtractor", folder)
        if extractor is not None and hasattr(extractor, "sampling_rate"):
            rate = int(extractor.sampling_rate)
            waves = [generator.standard_normal(rate).astype(np.float32) * 0.1 for _ in range(batch)]
            audio = extractor(waves, sampling_rate=rate, return_tensors="pt")
            inputs.update({k: v for k, v in _tensors(audio).items() if k in parameters})
    main = getattr(model, "main_input_name", "input_ids")
    if main not in inputs:
        return None
    return {name: value for name, value in inputs.items() if name in parameters}


def _text(tokenizer: Any, task: str, batch: int, seq: int) -> dict[str, torch.Tensor]:
    texts = [SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)] for i in range(batch)]
    pairs = [SAMPLE_PAIRS[i % len(SAMPLE_PAIRS)] for i in range(batch)] if task in TEXT_PAIR_TASKS else None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    padded = {"padding": "max_length", "truncation": True, "max_length": seq, "return_tensors": "pt"}
    if "boxes" in inspect.signature(tokenizer.__call__).parameters:
        # a document tokenizer (LayoutLMv2 / v3, LayoutXLM, UDOP) takes words with their boxes and
        # makes the model's ``bbox`` from them; a pair is a question and the document's words
        words = [text.split() for text in (pairs or texts)]
        boxes = [[_word_box(i) for i in range(len(row))] for row in words]
        return _tensors(tokenizer(texts if pairs else words, words if pairs else None, boxes=boxes, **padded))
    return _tensors(tokenizer(texts, pairs, **padded))


def _word_box(index: int) -> list[int]:
    """The ``index``-th word's box on one line of a page, on the 0-1000 scale layout models take."""
    left = min(900, 40 + 90 * index)
    return [left, 100, left + 80, 130]


def _tensors(encoded: Any) -> dict[str, Any]:
    return {name: value for name, value in dict(encoded).items() if isinstance(value, torch.Tensor)}


def _image(generator: np.random.Generator) -> np.ndarray:
    return generator.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)


def _has_image_placeholder(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return any(getattr(config, key, None) is not None for key in ("image_token_id", "image_token_index"))


def _load(auto_class: str, folder: Path) -> Any:
    """``transformers.<auto_class>.from_pretrained(folder)``, or ``None`` when the folder has none."""
    import transformers

    try:
        return getattr(transformers, auto_class).from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.debug("no %s in %s: %s", auto_class, folder, error)
        return None
