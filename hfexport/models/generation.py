"""decompose_for_generation: split a generative model into the components its generation loop
runs (prefill, decode, encoders, …) with the real keyword arguments of each.

``model.generate`` runs once (2 new tokens, 3 with multi-token decode) with forward pre-hooks
that copy every call's kwargs; the copies are what each component is exported with. The caller's
model, inputs and generation config are not changed.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from hfexport.computed_weights import conversions_reused
from hfexport.errors import ConfigError, HfExportError, UnsupportedModelError
from hfexport.models.frontend import normalize_inputs
from hfexport.models.static_layers import with_encoder_length_cross_attention
from hfexport.models.vision import REQUIRED_VISION_INDICES, VisionEncoderWithIndices, recording_vision_indices
from hfexport.pipeline.eval_mode import eval_mode
from hfexport.pipeline.inputs import copy_inputs
from hfexport.pipeline.patches import patches_applied

logger = logging.getLogger("hfexport")

Components = dict[str, tuple[torch.nn.Module, dict[str, Any]]]

# Flags generate sets that the exported graphs should not depend on: decode graphs return the
# logits of every query position and take no use_cache / return_dict inputs (both on by default).
# Anything forward only receives through **kwargs is dropped too (see _clean): torch.export
# cannot take **kwargs inputs together with dynamic shapes.
_DROPPED_FLAGS = ("logits_to_keep", "use_cache", "return_dict", "output_attentions", "output_hidden_states")

# Where multimodal models keep the module mapping encoder features into the language model's
# embedding space, when they have one outside the encoder.
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "embed_vision", "embed_audio")


@contextmanager
def _recording(
    module: torch.nn.Module, calls: list[dict[str, Any]], returned: list[Returned] | None = None
) -> Iterator[None]:
    """Append a deep copy of the kwargs of every ``module`` call (copied before the call runs,
    so the cache is recorded in the state the call received), and to ``returned`` what each
    call handed back (:class:`Returned`)."""

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if args:
            names = list(inspect.signature(_module.forward).parameters)
            kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
        calls.append(copy.deepcopy(kwargs))

    def after(_module: torch.nn.Module, _args: tuple, _kwargs: dict[str, Any], output: Any) -> None:
        values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else ()
        logits = getattr(output, "logits", None)
        last = logits[:, -1].detach().clone() if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None
        returned.append(Returned(any(holds_cache(v) for v in values), last))

    handles = [module.register_forward_pre_hook(hook, with_kwargs=True)]
    if returned is not None:
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class Returned:
    """What one recorded forward call handed back: whether a cache, and its last position's logits."""

    cache: bool
    last_logits: torch.Tensor | None


def _forward_parameters(module: torch.nn.Module) -> set[str]:
    return {
        name
        for name, p in inspect.signature(module.forward).parameters.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }


def holds_cache(value: Any) -> bool:
    """Whether a forward argument carries generation state: a transformers cache, or a legacy
    tuple of past tensors (``mems``, ``past_key_values`` as tuples)."""
    from transformers.cache_utils import Cache

    from hfexport.models.caches import EncoderStates

    if isinstance(value, Cache) or type(value).__name__.endswith("Cache"):
        return True
    if isinstance(value, EncoderStates):  # an encoder-decoder's encoder outputs: a tuple of tensors too
        return False
    return (
        isinstance(value, (tuple, list))
        and bool(value)
        and all(isinstance(v, (torch.Tensor, tuple, list)) for v in value)
    )


def _clean(module: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop ``None`` values and call flags; keep what ``forward`` takes by name. The encoder's
    outputs become a tuple (see :func:`_plain_encoder_outputs`)."""
    named = _forward_parameters(module)
    kept = {k: v for k, v in kwargs.items() if v is not None and k not in _DROPPED_FLAGS and k in named}
    return _plain_encoder_outputs(kept)


def _plain_encoder_outputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """generate hands an encoder-decoder's prefill and decode ``encoder_outputs`` as a
    ``ModelOutput``; a saved ``.pt2`` pickles its example inputs, and a ``ModelOutput`` is not
    among what a weights-only load rebuilds, so loading the folder would need ``--trust-artifact``.
    They become :class:`~hfexport.models.caches.EncoderStates` (a tuple that also answers its
    fields' names): the program's inputs are ``encoder_outputs.<index>``."""
    from transformers.utils import ModelOutput

    from hfexport.models.caches import EncoderStates

    outputs = kwargs.get("encoder_outputs")
    if isinstance(outputs, ModelOutput):
        unset = [field.name for field in dataclasses.fields(outputs) if field.name not in outputs]
        kwargs = {**kwargs, "encoder_outputs": EncoderStates(outputs.to_tuple(), outputs.keys(), unset)}
    return kwargs


def _with_attention_mask(kwargs: dict[str, Any], past: int) -> dict[str, Any]:
    """generate drops an all-ones attention mask; put it back (``past`` cached tokens + this
    call's) so the exported graph's inputs do not depend on whether the sample prompt had
    padding. Encoder-decoder calls keep the encoder's mask and get none, and so do models whose
    cache holds no attention keys (Mamba's recurrent states): their mask covers this call's tokens
    only, and their generate passes none after the prompt."""
    if "attention_mask" in kwargs or "input_ids" not in kwargs or not _has_attention_cache(kwargs):
        return kwargs
    batch, length = kwargs["input_ids"].shape[:2]
    return {**kwargs, "attention_mask": torch.ones(batch, past + length, dtype=torch.long)}


def _has_attention_cache(kwargs: dict[str, Any]) -> bool:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    return layers is None or any(hasattr(layer, "keys") for layer in layers)


def _with_prompt_mask(kwargs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """generate hands the prefill the caller's 2-D mask, a per-layer-type dict of 4-D masks, or a
    dict of ``None`` (an all-ones mask it could skip), depending on the model, the cache and the
    sample's padding. The prefill graph always takes the 2-D prompt mask (the model builds its
    masks from it), so its inputs do not depend on the sample's content. Encoder-decoder prefills
    (no ``input_ids``) keep the encoder's mask."""
    if "input_ids" not in kwargs:
        return kwargs
    mask = inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.shape != kwargs["input_ids"].shape:
        mask = torch.ones_like(kwargs["input_ids"])
    return {**kwargs, "attention_mask": mask.clone()}


def _mask_as_generate_passes(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with its 2-D attention mask in the form ``generate`` hands a model that makes its
    own masks for generation from a 2-D one (BLOOM's ALiBi: the mask padded to the static cache's
    length), as it does for a padded prompt; it passes none for an all-ones one, which the
    recorded calls lack."""
    from transformers.generation.utils import GenerationMixin

    mask, cache = kwargs.get("attention_mask"), kwargs.get("cache")
    own = type(model).create_masks_for_generate if hasattr(type(model), "create_masks_for_generate") else None
    if own is None or own is getattr(GenerationMixin, "create_masks_for_generate", None) or cache is None:
        return kwargs
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return kwargs
    try:
        made = model.create_masks_for_generate(
            config=model.config,
            inputs_embeds=torch.empty((*kwargs["input_ids"].shape[:2], 0)),
            attention_mask=mask,
            cache=cache,
            position_ids=kwargs.get("position_ids"),
        )
    except Exception:  # the model's own mask code: the mask stays as it was recorded
        return kwargs
    if isinstance(made, torch.Tensor) and made.dim() == 2:
        return {**kwargs, "attention_mask": made.contiguous()}
    return kwargs


def _single_layer_type_mask(kwargs: dict[str, Any]) -> dict[str, Any]:
    """generate hands some models' decode (Qwen3 with a static cache) a per-layer-type dict of
    masks even when every layer has the same type; the decode graph then takes the one 4-D mask
    itself, as the model accepts it and as the spec's decode loop passes it. Models with several
    layer types (sliding + full) keep the dict."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict) and len(mask) == 1:
        (only,) = mask.values()
        if isinstance(only, torch.Tensor):
            return {**kwargs, "attention_mask": only}
    return kwargs


def _cat(first: Any, second: Any, dim: int) -> Any:
    if isinstance(first, dict):
        return {k: _cat(first[k], second[k], dim) for k in first}
    if first is None:
        return None
    return torch.cat([first, second], dim=dim)


def merge_decode_steps(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One decode call covering two consecutive steps: tokens and positions concatenated on the
    query axis, the cache as the first step received it, the mask of the second step (2-D) or
    both steps' rows (4-D / per-layer-type dict), so the query axis is traced as symbolic."""
    merged = dict(first)
    for key in ("input_ids", "position_ids", "cache_position", "decoder_input_ids", "decoder_position_ids"):
        if key in first:
            merged[key] = _cat(first[key], second[key], dim=-1)
    for key in ("attention_mask", "decoder_attention_mask"):
        mask = first.get(key)
        if mask is None:
            continue
        is_2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        merged[key] = second[key] if is_2d else _cat(mask, second[key], dim=-2)
    return merged


def _check_prompt_is_causal(model: torch.nn.Module, inputs: Any) -> None:
    """Raise :class:`UnsupportedModelError` when a prompt token's logits change with a later prompt
    token (a prefix-LM: PaliGemma's text prompt attends both ways): hfexport's decode loops feed
    the prompt through the decode graph with a causal mask and would generate other tokens than
    ``generate``, silently. Checked eagerly on the sample's ids, the last one changed."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
        return
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % max(int(getattr(model.config.get_text_config(), "vocab_size", 2)), 2)
    mask = inputs.get("attention_mask")
    # both prompts in one forward, as rows of one batch: the weights are read (and a model stored
    # narrower than it computes in converted) once, not twice
    both = {"input_ids": torch.cat([ids, changed])}
    if isinstance(mask, torch.Tensor):
        both["attention_mask"] = torch.cat([mask, mask])
    try:
        with torch.no_grad(), eval_mode(model):
            before, after = model(**both).logits[:, :-1].split(len(ids))
    except Exception:  # a model that needs more than its ids (pixel values): generate itself will say
        return
    # the rows of one batch may take other kernel paths: rounding, not a prefix language model's
    # change, is a few units in the last place
    if not torch.allclose(before, after, rtol=1e-5, atol=1e-5):
        raise UnsupportedModelError(
            f"{type(model).__name__}'s prompt tokens attend to later prompt tokens (a prefix language model), "
            "and hfexport's decode loops feed the prompt causally, so they would generate other tokens than "
            "generate; export it without --generation"
        )


def _check_static_layer_types(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` when a layer type of the model's config has no static
    cache layer in transformers: generate cannot build the static cache the components are recorded
    with (it raised a bare ``KeyError`` naming the type: DeepSeek-V4's ``heavily_compressed_attention``)."""
    from transformers import cache_utils

    try:
        layer_types, _ = cache_utils.get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    except Exception:  # a config StaticCache would fail on too: generate's own error says which
        return
    unknown = sorted(set(layer_types) - set(cache_utils.STATIC_LAYER_TYPE_MAPPING))
    if unknown:
        raise UnsupportedModelError(
            f"{type(model).__name__} has layer types {unknown} for which transformers has no static cache layer "
            "(cache_utils.STATIC_LAYER_TYPE_MAPPING), and hfexport's generation export records the model with a "
            "static cache; export it without --generation"
        )


@conversions_reused()  # generate and the checks run the model eagerly five times
def decompose_for_generation(
    model: torch.nn.Module,
    inputs: Any,
    generation_config: Any = None,
    multi_token_decode: bool = False,
) -> Components:
    """``{component: (submodule, forward_kwargs)}`` for ``model``'s generation loop.

    Decoder-only models give ``prefill`` and ``decode``; encoder-decoder models (T5, Bart,
    Whisper) also ``encoder``, recorded by a hook on ``model.get_encoder()`` because generate runs
    it before the loop. Multimodal models (found by ``get_encoder(modality="image"/"audio")``)
    give ``image_encoder`` / ``audio_encoder``, their projector when the model has one under a
    name of :data:`PROJECTOR_NAMES`, ``language_model`` (``get_decoder()``), ``lm_head`` and
    ``decode``: the prefill is those components, each hooked, since generate encodes the media
    inside the first forward. A vision encoder that derives its position ids and per-image
    boundaries from ``grid_thw`` with data-dependent ops (Qwen2-VL) is given as a
    :class:`VisionEncoderWithIndices`, which takes them as inputs.

    A static cache's sliding-window layers are recorded as full-length
    :class:`~hfexport.models.static_layers.WindowedStaticLayer` s, so one decode graph stays
    correct before and after the window fills.

    With ``multi_token_decode=True`` the decode kwargs cover two merged steps, so the exported
    decode graph keeps its query length symbolic. ``generation_config`` (e.g.
    ``cache_implementation="static"``) is used as given; the caller's copy is not changed.
    """
    from transformers import GenerationConfig

    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not generate (it has no language-model head: can_generate() is "
            "False), so it has no generation components; export it without --generation / export_for_generation"
        )
    inputs = normalize_inputs(inputs, model)
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    new_tokens = 3 if multi_token_decode else 2
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    cache_len = getattr(config, "max_cache_len", None)
    if cache_len is not None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
        # generate would build a cache long enough for the sample, not the one asked for
        if ids.shape[1] + new_tokens > cache_len:
            raise ConfigError(
                f"max_cache_len={cache_len} cannot hold the sample prompt ({ids.shape[1]} tokens) and the "
                f"{new_tokens} tokens generated while recording the components; raise max_cache_len or "
                f"give a prompt of at most {cache_len - new_tokens} tokens"
            )
    _check_static_layer_types(model)
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.do_sample = False
    config.num_beams = 1  # the decode loops take one row per prompt: beams would multiply the recorded batch
    if config.pad_token_id is None:
        config.pad_token_id = getattr(model.generation_config, "pad_token_id", None) or 0

    calls: list[dict[str, Any]] = []
    returned: list[Returned] = []
    # Submodules transformers runs outside the top-level forward (an encoder-decoder's encoder,
    # before the loop) or inside the prefill (a multimodal model's encoders, projector, language
    # model and head): each gets its own hook.
    submodules = _generation_submodules(model)
    sub_calls: dict[str, list[dict[str, Any]]] = {name: [] for name in submodules}
    with ExitStack() as scope:
        scope.enter_context(eval_mode(model))
        scope.enter_context(patches_applied(scope="generate"))
        vision_indices = scope.enter_context(recording_vision_indices())
        scope.enter_context(_recording(model, calls, returned))
        for name, module in submodules.items():
            scope.enter_context(_recording(module, sub_calls[name]))
        try:
            model.generate(**copy_inputs(inputs), generation_config=config)
        except (IndexError, RuntimeError, TypeError) as error:
            # e.g. CPM-Ant: prompt_length ids of its own overflow a cache of 32, and its mask does not
            # follow a longer static cache; T5Gemma 2's decoder masks find no cross-attention mask
            more = f" of {cache_len} tokens" if cache_len else ""
            raise HfExportError(
                f"{type(model).__name__}.generate failed on the sample prompt with the static cache{more} "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}): its code may not "
                "support a static cache, may need inputs the sample lacks (a processor's), or may add tokens of its "
                "own to the prompt (then a larger --max-cache-len helps)"
            ) from error
    if len(calls) < new_tokens:
        raise HfExportError(
            f"generate made {len(calls)} forward calls, expected {new_tokens}; cannot tell prefill from decode"
        )
    if not any(holds_cache(value) for value in _clean(model, calls[1]).values()):
        return {"decode": (model, _whole_sequence_step(model, calls, submodules))}
    # generate asks for the cache (use_cache=True); a model that hands none back (a BERT-style model with
    # is_decoder=False) runs the whole sequence again at each step under generate
    if "use_cache" in _forward_parameters(model) and not returned[0].cache:
        raise UnsupportedModelError(
            f"{type(model).__name__} returns no cache from its forward with this config (generate runs the whole "
            "sequence again at each step; a BERT-style model with is_decoder=False attends both ways), and "
            "hfexport's generation export is a cached decode step; export it without --generation, or set "
            "is_decoder=True in the config if the checkpoint is a decoder"
        )
    if not getattr(model.config, "is_encoder_decoder", False):
        _check_prompt_is_causal(model, inputs)
    prefill = _mask_as_generate_passes(model, _with_prompt_mask(_clean(model, calls[0]), inputs))
    prefill = with_encoder_length_cross_attention(prefill)
    decode = calls[1]
    if multi_token_decode:
        merged = merge_decode_steps(calls[1], calls[2])
        failure = _multi_token_decode_mismatch(model, calls[1:3], returned[1:3], merged)
        if failure is None:
            decode = merged
        else:
            logger.warning(
                "%s's decode cannot take several new tokens at once (%s); its decode graph takes one token per step",
                type(model).__name__,
                failure,
            )
    # the cache can't always tell its length (SSM caches hold states, not tokens): count it
    prompt_length = prefill["input_ids"].shape[1] if "input_ids" in prefill else 0
    decode = _with_attention_mask(_clean(model, decode), past=prompt_length)
    decode = _single_layer_type_mask(_mask_as_generate_passes(model, decode))
    if sub_calls.get("encoder"):
        prefill, decode = (_without_encoder_inputs(kwargs, sub_calls["encoder"][0]) for kwargs in (prefill, decode))
    components: Components = {}
    for name, module in submodules.items():
        if not sub_calls[name]:
            raise HfExportError(
                f"generate never called {type(model).__name__}'s {name} ({type(module).__name__}), so its inputs "
                "are unknown; check that the sample inputs exercise it (e.g. pixel_values for an image encoder)"
            )
        kwargs = _clean(module, sub_calls[name][0])
        if name == "image_encoder" and set(REQUIRED_VISION_INDICES) <= set(vision_indices) and "grid_thw" in kwargs:
            # the wrapper hands its patches on positionally, whatever the encoder calls them
            # (hidden_states in Qwen2-VL, pixel_values in MiniMax-M3-VL)
            patches = next(iter(inspect.signature(module.forward).parameters), "hidden_states")
            kwargs = {("hidden_states" if k == patches else k): v for k, v in kwargs.items()}
            module, kwargs = VisionEncoderWithIndices(module), {**kwargs, **vision_indices}
        if name == "encoder" and _merges_embeddings_first(kwargs, inputs):
            module, kwargs = EncoderOfPrompt(model), {k: v for k, v in inputs.items() if not k.startswith("decoder_")}
        components[name] = (module, kwargs)
    if "language_model" not in components:  # multimodal prefill = the hooked components
        components["prefill"] = (model, prefill)
    components["decode"] = (model, decode)
    return components


class EncoderOfPrompt(torch.nn.Module):
    """An encoder-decoder's encoder step from the prompt's own inputs, as generate runs it
    (``_maybe_prepare_encoder_kwargs_for_generation``). For a model that merges its image features
    into the text embeddings before the text encoder (Florence-2), ``get_encoder()`` alone takes
    the merged embeddings, which a decode loop fed with ids and pixels cannot make."""

    INPUTS = ("input_ids", "attention_mask", "pixel_values")

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
    ) -> Any:
        given = {"attention_mask": attention_mask, "pixel_values": pixel_values}
        prepared = self.model._maybe_prepare_encoder_kwargs_for_generation(
            input_ids, {k: v for k, v in given.items() if v is not None}, "input_ids", self.model.generation_config
        )
        return prepared["encoder_outputs"]


def _merges_embeddings_first(encoder_call: dict[str, Any], inputs: Any) -> bool:
    """Whether generate handed the encoder embeddings it made itself from the prompt's ids (and
    media), rather than the prompt's inputs."""
    return (
        "inputs_embeds" in encoder_call
        and "input_ids" not in encoder_call
        and isinstance(inputs, dict)
        and isinstance(inputs.get("input_ids"), torch.Tensor)
        and {k for k in inputs if not k.startswith("decoder_")} <= set(EncoderOfPrompt.INPUTS)
    )


def _without_encoder_inputs(kwargs: dict[str, Any], encoder_call: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder step given ``encoder_outputs`` without the inputs only the encoder reads,
    which generate hands every step too (UDOP's word boxes ``bbox``): the padding mask stays, since
    the cross-attention reads it."""
    if "encoder_outputs" not in kwargs:
        return kwargs
    only_encoder = set(encoder_call) - {"attention_mask"}
    return {name: value for name, value in kwargs.items() if name not in only_encoder}


def _whole_sequence_step(
    model: torch.nn.Module, calls: list[dict[str, Any]], submodules: dict[str, torch.nn.Module]
) -> dict[str, Any]:
    """The decode graph's sample for a model whose forward takes no cache (GPT-1, Evolla):
    ``generate`` runs the whole sequence again at each step, and so does the graph. The sample is
    its second step (the prompt and one new token) with the attention mask it dropped."""
    kwargs = _clean(model, calls[1])
    ids, prompt = kwargs.get("input_ids"), calls[0].get("input_ids")
    grown = isinstance(ids, torch.Tensor) and isinstance(prompt, torch.Tensor) and ids.shape[1] == prompt.shape[1] + 1
    if submodules or not grown:
        raise UnsupportedModelError(
            f"{type(model).__name__} generates without a cache (each step runs the whole sequence again: generate "
            "passes its forward no past keys and values); hfexport exports that as one graph over the whole sequence "
            "for a decoder-only text model only; export it without --generation"
        )
    logger.info("%s generates without a cache: its decode graph takes the whole sequence", type(model).__name__)
    if "attention_mask" in _forward_parameters(model) and "attention_mask" not in kwargs:
        kwargs["attention_mask"] = torch.ones_like(ids)  # generate drops an all-ones mask
    return kwargs


def _multi_token_decode_mismatch(
    model: torch.nn.Module, steps: list[dict[str, Any]], returned: list[Returned], merged: dict[str, Any]
) -> str | None:
    """Why one decode call over two merged steps does not give the logits of the two steps
    ``generate`` ran one at a time (``returned``, or the ``steps`` run again where generate's
    output had no logits), or ``None`` when it does (run in eager mode, on copies).
    Mamba's forward raises with a filled cache and several tokens or, in its full-sequence form,
    restarts from a zero recurrent state: both are caught here."""
    try:
        with torch.no_grad(), eval_mode(model):
            expected = [
                given.last_logits
                if given.last_logits is not None
                else model(**copy_inputs(_clean(model, step))).logits[:, -1]
                for step, given in zip(steps, returned, strict=True)
            ]
            got = model(**copy_inputs(_clean(model, merged))).logits
    except Exception as error:  # the model's own failure, reported as the reason
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    difference = max(float((got[:, i] - e).abs().max()) for i, e in enumerate(expected))
    # a gross disagreement, not rounding: batched and one-at-a-time matmuls differ in the last bits
    scale = max(1.0, max(float(e.abs().max()) for e in expected))
    return None if difference <= 1e-3 * scale else f"its logits differ from two single steps by {difference:.3g}"


def _generation_submodules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The submodules to export besides the top-level model, by component name."""
    if getattr(model.config, "is_encoder_decoder", False):
        return {"encoder": model.get_encoder()}
    found: dict[str, torch.nn.Module] = {}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for modality in ("image", "audio"):
        try:
            encoder = model.get_encoder(modality=modality)
        except (TypeError, ValueError, AttributeError, NotImplementedError):
            continue
        if isinstance(encoder, torch.nn.Module) and encoder is not decoder and encoder is not model:
            found[f"{modality}_encoder"] = encoder
    if not found:
        return {}
    for name in PROJECTOR_NAMES:
        projector = _find_attribute(model, name)
        if isinstance(projector, torch.nn.Module):
            found[name] = projector
    found["language_model"] = decoder
    found["lm_head"] = model.get_output_embeddings()
    return found


def _find_attribute(model: torch.nn.Module, name: str) -> Any:
    for module in (model, getattr(model, "model", None)):
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None


def runtime_facts(model: torch.nn.Module) -> dict[str, Any]:
    """What a runtime's own generation loop needs to know about ``model`` besides its decode
    graph: its special token ids (``eos_token_id`` as a list: the generation config's, else the
    config's), vocabulary size, hidden size and attention heads (the text model's, for a
    multimodal one). Recorded in the export manifest's ``generation`` entry; the targets write
    their runtimes' configs from it (ONNX Runtime GenAI's ``genai_config.json``)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    generation = getattr(model, "generation_config", None)

    def token(name: str) -> Any:
        value = getattr(generation, name, None)
        return value if value is not None else getattr(config, name, None)

    eos = token("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else [int(i) for i in eos]
    facts = {
        "bos_token_id": token("bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": token("pad_token_id"),
        "vocab_size": getattr(config, "vocab_size", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
    }
    return {key: value for key, value in facts.items() if value is not None}
