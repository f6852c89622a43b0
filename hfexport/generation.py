"""Generation with exported programs, backend-neutral: the greedy decode loop over a static-cache
decode graph, the attention masks it feeds, the decoders' shared bases, and what a generation
returns (:class:`Generation`, :class:`TokenStream`). Each target's decoder (``hfexport.targets.*``)
builds on these and supplies the ``step`` function that runs its artifact; the text front ends that
open an export folder through the targets sit above them (:mod:`hfexport.text_generator`,
:mod:`hfexport.seq2seq`). This module imports no target.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hfexport.errors import HfExportError


def decode_mask(
    valid: torch.Tensor, query_slots: torch.Tensor, window: int | None = None, chunk: int | None = None
) -> torch.Tensor:
    """The 4-D boolean mask ``[batch, 1, queries, cache_len]`` of a static-cache decode step:
    query at cache slot ``s`` sees slot ``j`` when ``j <= s`` and ``valid[b, j]`` (written and not
    padding), and, for a sliding-window layer type, ``s - j < window``; for a chunked one (Llama
    4), ``j`` and ``s`` lie in one chunk of ``chunk`` slots counted from the row's first token, as
    transformers' chunked mask counts them past the left padding.

    Built with numpy: a decode step runs it between two program calls, when the caches are cold
    and each torch operator's dispatch costs tens of microseconds."""
    cache_len = valid.shape[-1]
    queries = np.asarray(query_slots)
    if len(queries) and int(queries.max()) >= cache_len:
        raise HfExportError(
            f"this step writes cache slot {int(queries.max())}, past the static cache's {cache_len} slots: the "
            "prompt and the tokens so far fill it; start a new sequence (reset() the decoder; greedy_decode does) "
            "or export with a larger max_cache_len"
        )
    slots = np.arange(cache_len)[None, :]
    visible = slots <= queries[:, None]
    if window is not None:
        visible &= slots > queries[:, None] - window
    rows = np.asarray(valid) != 0
    if chunk is not None:
        first = rows.argmax(axis=-1)[:, None, None]  # the left padding
        visible = visible[None] & ((slots[None] - first) // chunk == (queries[None, :, None] - first) // chunk)
        return torch.from_numpy(visible & rows[:, None, :])[:, None]
    return torch.from_numpy(visible[None] & rows[:, None, :])[:, None]


class DecodeMasks:
    """Builds a decode graph's attention masks in the structure and dtype it was exported with
    (boolean, or additive float for eager attention): one 4-D ``attention_mask`` (``layer_types``
    None; windowed when ``windows`` has the one window of a model whose layers all slide), or one
    per layer type (``attention_mask.<type>``
    inputs), each layer type in ``windows`` limited to its sliding window (``chunked_attention``: to
    its chunk). Raises
    :class:`~hfexport.HfExportError` up front for a layer type it cannot build."""

    def __init__(
        self,
        layer_types: list[str] | None,
        windows: dict[str, int],
        dtypes: dict[str, torch.dtype] | None = None,
        name: str = "attention_mask",
        key_padding_length: int | None = None,
    ) -> None:
        unsupported = sorted(set(layer_types or ()) - {"full_attention"} - set(windows))
        self.chunks = {key: windows[key] for key in windows if key == "chunked_attention"}
        if unsupported:
            raise HfExportError(
                f"the decode graph takes attention masks for layer types {unsupported}; the decode loops "
                "build full-attention masks and the sliding-window masks of windowed static layers only "
                "(export with hfexport's export_for_generation and a static cache)"
            )
        self.layer_types = layer_types
        self.windows = windows
        self.dtypes = dtypes or {}
        self.name = name  # the input's name: an encoder-decoder's decoder takes decoder_attention_mask
        # one 2-D mask over the static cache's slots, from which the model makes its own masks
        # (BLOOM's ALiBi): fed which slots hold a token
        self.key_padding_length = key_padding_length

    def check_cache_length(self, cache_len: int) -> None:
        """Raise :class:`~hfexport.HfExportError` when the graph's 2-D mask does not span the
        static cache's ``cache_len`` slots (a model whose own cache grows, as MiniMax's)."""
        if self.key_padding_length not in (None, cache_len):
            raise HfExportError(
                f"the decode program takes a 2-D attention mask of {self.key_padding_length} tokens, not one over "
                f"its static cache's {cache_len} slots: it writes no cache in place (a model whose own cache class "
                "grows, as MiniMax's); export decode with a static cache"
            )

    @classmethod
    def from_input_paths(
        cls,
        paths: list[str],
        windows: dict[str, int],
        dtypes: dict[str, torch.dtype] | None = None,
        name: str = "attention_mask",
        shapes: dict[str, Any] | None = None,
    ) -> DecodeMasks:
        """From a decode graph's input keyword paths: ``<name>.<layer type>`` for a per-layer-type
        mask dict, else one ``<name>``; ``dtypes`` and ``shapes`` by path (a 2-D ``<name>``: a
        mask over the cache's slots)."""
        types = [path.split(".", 1)[1] for path in paths if path.startswith(f"{name}.")]
        shape = (shapes or {}).get(name)
        padding = int(shape[1]) if shape is not None and len(shape) == 2 else None
        return cls(types or None, windows, dtypes, name, padding)

    @classmethod
    def of_component(cls, spec: Any, cache_len: int) -> DecodeMasks:
        """The masks a decode component's manifest entry (``spec``, a
        :class:`~hfexport.targets.manifest.ComponentSpec`) takes, checked against its cache's
        ``cache_len``."""
        masks = cls.from_input_paths(
            [i.path for i in spec.fed],
            spec.attention_windows,
            {i.path: getattr(torch, i.dtype) for i in spec.fed if i.path.startswith("attention_mask")},
            shapes={i.path: i.shape for i in spec.fed},
        )
        masks.check_cache_length(cache_len)
        return masks

    def _typed(self, path: str, mask: torch.Tensor) -> torch.Tensor:
        # eager attention adds its mask to the scores: 0 where visible, the dtype's minimum where not
        dtype = self.dtypes.get(path, torch.bool)
        if dtype == torch.bool:
            return mask
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)

    def rules(self) -> dict[str, tuple[int | None, int | None]]:
        """``{input path: (window, chunk)}`` of each mask the decode graph takes (see
        :func:`decode_mask`): what every implementation of the mask rule (these numpy masks, the
        ONNX and ExecuTorch graphs' own) builds each mask input from. Empty for a 2-D mask over
        the cache's slots, which is the slots' validity alone."""
        if self.key_padding_length is not None:
            return {}
        if self.layer_types is None:
            # one mask serves every layer: when the cache's layers are windowed, all of them are
            # (Mistral, whose mask function applies the window to 2-D masks only)
            (key, span), *others = list(self.windows.items()) or [(None, None)]
            if others:
                key, span = None, None
            chunk = span if key == "chunked_attention" else None
            return {self.name: (None if chunk is not None else span, chunk)}
        return {
            f"{self.name}.{key}": (None, self.chunks[key]) if key in self.chunks else (self.windows.get(key), None)
            for key in self.layer_types
        }

    def structured(self, valid: torch.Tensor, query_slots: torch.Tensor) -> Any:
        """The mask, or ``{layer type: mask}``, as the model's ``attention_mask`` argument."""
        if self.key_padding_length is not None:
            return valid.to(self.dtypes.get(self.name, torch.long))
        masks = {
            path: self._typed(path, decode_mask(valid, query_slots, window, chunk))
            for path, (window, chunk) in self.rules().items()
        }
        if self.layer_types is None:
            return masks[self.name]
        return {path.split(".", 1)[1]: mask for path, mask in masks.items()}

    def by_input_path(self, valid: torch.Tensor, query_slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The masks by flat input path (``attention_mask`` or ``attention_mask.<layer type>``)."""
        masks = self.structured(valid, query_slots)
        if isinstance(masks, dict):
            return {f"{self.name}.{key}": mask.contiguous() for key, mask in masks.items()}
        return {self.name: masks.contiguous()}


class StaticCacheDecoder:
    """What the targets' decoders share: the static cache the decode graph reads and writes
    (``cache``: tensors by input path, or the cache object's pytree) and its length."""

    cache: Any
    max_cache_len: int
    position_rows: int | None = None  # a decode graph's multimodal rotary positions: [rows, batch, queries]

    def positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The loop's ``[batch, queries]`` positions as the decode graph takes them: a graph of
        multimodal rotary positions (Qwen-VL's three rows, GLM-4V's four) gets one row per axis,
        all equal, as a text token's are."""
        if self.position_rows is None:
            return position_ids
        return position_ids[None].expand(self.position_rows, -1, -1).contiguous()

    @staticmethod
    def token_types(specs: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zeros (text) for a decode graph's token-type inputs (a multimodal model's
        ``mm_token_type_ids``, which marks image tokens; ``specs``: the manifest's inputs), as long
        as the step's ids where the graph ties them, else of the shape it was exported with."""
        return {
            spec.path: torch.zeros_like(input_ids) if 1 in spec.dynamic else torch.zeros(spec.shape, dtype=torch.long)
            for spec in specs
            if spec.path.endswith("token_type_ids")
        }

    @staticmethod
    def cache_length(mask_shapes: list[Any], cache_shapes: list[Any]) -> int:
        """The static cache's length: the key axis of the decode graph's 4-D attention masks (the
        slots a query can see), else the longest axis 2 of its 4-D cache tensors. A hybrid's 4-D
        recurrent states beside the keys and values are not slots (Nemotron-H's: 64 against 32)."""
        keys = [int(shape[3]) for shape in mask_shapes if shape is not None and len(shape) == 4]
        if keys:
            return max(keys)
        return max(int(shape[2]) for shape in cache_shapes if len(shape) == 4)

    @staticmethod
    def rows_of(shape: Any) -> int | None:
        """``position_rows`` for a decode graph's ``position_ids`` of ``shape`` (None: 2-D)."""
        return int(shape[0]) if shape is not None and len(shape) == 3 else None

    @staticmethod
    def check_batch_size(spec: Any, batch_size: int) -> None:
        """Raise :class:`HfExportError` when the decode program (its manifest ``spec``) cannot take
        ``batch_size`` rows: a static batch of another size, or a dynamic batch bounded below it."""
        held = (i for i in spec.inputs if (i.state or i.name in spec.write_backs) and len(i.shape) >= 2)
        cache = next(held, None)
        if cache is None:
            return
        # a dynamic batch's recorded minimum is torch.export's (2), and one row runs: only the maximum binds
        high = cache.dynamic[0][1] if 0 in cache.dynamic else cache.shape[0]
        static = 0 not in cache.dynamic
        if (static and batch_size != high) or (high is not None and batch_size > high):
            exported = f"a static batch of {high}" if static else f"a batch of at most {high}"
            raise HfExportError(
                f"the decode program was exported with {exported} and cannot decode {batch_size} rows; export "
                "it again for that batch (an ExecuTorch generation export takes one row unless "
                "ExecutorchConfig(max_batch_size=...) is set)"
            )

    def reset(self) -> None:
        """Empty the cache (keys, values and token counters), in place, so the next call starts
        a new sequence; :func:`greedy_decode` calls it before each prompt."""
        import torch.utils._pytree as pytree

        for tensor in pytree.tree_leaves(self.cache):
            if isinstance(tensor, torch.Tensor):
                tensor.zero_()


class RecurrentDecoder(StaticCacheDecoder):
    """A decode ``step`` (see :func:`greedy_decode`) over a ``prefill`` and a ``decode`` program
    that carry a recurrent state and no attention cache (Mamba's convolution and SSM states,
    RWKV's ``state.*``): the prefill reads the prompt and returns the states, each decode step
    takes them with the new token and returns them updated. The states are the programs' own
    outputs, fed back by path (no initial value is assumed: RWKV's starts at -1e30 in one slot).
    There is no cache to fill, so ``max_cache_len`` is only the loop's bookkeeping; prompts must
    share one length (a padding token would enter the state)."""

    max_cache_len = 1 << 16

    def __init__(self, prefill: Any, decode: Any, batch_size: int) -> None:
        self.prefill, self.decode = prefill, decode
        self.check_batch_size(decode.spec, batch_size)
        fed = {"input_ids", "attention_mask"}
        self.state_paths = [spec.path for spec in decode.spec.fed if spec.path not in fed]
        made = {o.path for o in prefill.spec.returned} & {o.path for o in decode.spec.returned}
        missing = [path for path in self.state_paths if path not in made]
        if missing:
            raise HfExportError(
                f"the decode program takes {missing[0]}, which the prefill and decode programs do not both return; "
                "hfexport's recurrent decode loop feeds back states only: run the folder's programs yourself"
            )
        self.cache: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self.cache = {}

    def _run(self, runner: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        fed: dict[str, Any] = {"input_ids": input_ids.contiguous(), **self.cache}
        if any(spec.path == "attention_mask" for spec in runner.spec.fed):
            fed["attention_mask"] = mask.contiguous()  # what generate passes: every token so far
        produced = runner.run_named(fed)
        self.cache = {path: torch.as_tensor(produced[path]).clone() for path in self.state_paths}
        return torch.as_tensor(produced["logits"])

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: Any
    ) -> torch.Tensor:
        end = int(query_slots[-1]) + 1
        mask = valid[:, :end]
        if not bool(mask.all()):
            raise HfExportError(
                "a recurrent model's decode loop takes prompts of one length (a padding token would enter its "
                "state); generate the prompts one at a time"
            )
        if not self.cache:
            return self._run(self.prefill, input_ids, mask)
        return self._run(self.decode, input_ids, mask)


class WholeSequenceDecoder:
    """A decode ``step`` (see :func:`greedy_decode`) over a program that takes no cache (GPT-1,
    Evolla: their forward takes no past keys and values, and ``generate`` runs the whole sequence
    at each step): each call appends the new tokens and runs the program on every token so far,
    with the loop's mask and positions. ``max_cache_len`` is the longest sequence it runs (the
    smaller of the program's bound and the export's ``max_cache_len``)."""

    def __init__(self, decode: Any, max_cache_len: int) -> None:
        self.decode = decode
        self.max_cache_len = max_cache_len
        self.takes = {spec.path for spec in decode.spec.fed}
        self.input_ids: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None

    def reset(self) -> None:
        self.input_ids = self.position_ids = None

    @staticmethod
    def _grown(sequence: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new if sequence is None else torch.cat([sequence, new], dim=-1)

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: Any
    ) -> torch.Tensor:
        self.input_ids = self._grown(self.input_ids, input_ids)
        fed: dict[str, Any] = {"input_ids": self.input_ids.contiguous()}
        if "attention_mask" in self.takes:
            fed["attention_mask"] = valid[:, : self.input_ids.shape[1]].contiguous()
        if "position_ids" in self.takes:
            self.position_ids = self._grown(self.position_ids, torch.as_tensor(position_ids).reshape(input_ids.shape))
            fed["position_ids"] = self.position_ids.contiguous()
        return torch.as_tensor(self.decode.run_named(fed)["logits"])


class PromptInChunks:
    """A decode ``step`` (see :func:`greedy_decode`) over a decode program that takes at most
    ``size`` tokens per call (one: a decode exported with a query of one; a
    few: a model whose convolution state update takes fewer tokens than its kernel): the prompt
    goes in ``size`` tokens at a time. Other attributes (``reset``, ``max_cache_len``) are the
    wrapped step's."""

    def __init__(self, step: Callable[..., torch.Tensor], size: int = 1) -> None:
        self.step = step
        self.size = size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor, positions: Any
    ) -> torch.Tensor:
        # the mask's causal part hides the slots of the prompt tokens not fed yet
        per_token = isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[1] > 1
        for start in range(0, input_ids.shape[1], self.size):
            end = start + self.size
            position = positions[:, start:end] if per_token else positions
            logits = self.step(input_ids[:, start:end], valid, slots[start:end], position)
        return logits


@dataclass
class Sampling:
    """How the decode loop picks each next token from the last logits: the argmax with
    ``temperature`` 0 (greedy, the default), else a draw from the softmax of the logits divided
    by ``temperature``, kept to the ``top_k`` likeliest tokens and then to the smallest set whose
    probability reaches ``top_p`` (transformers' order of the same warpers). ``seed`` makes the
    draws repeatable (``None``: a fresh seed)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise HfExportError(f"temperature must be 0 (greedy) or more, got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise HfExportError(f"top_k must be a positive integer, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise HfExportError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.generator = torch.Generator()
        if self.seed is not None:
            self.generator.manual_seed(self.seed)
        else:
            self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[batch, 1]``: the next token of each row from its last logits."""
        if self.greedy:
            return _last_argmax(logits)
        scores = logits[:, -1].float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = torch.sort(scores, descending=True, dim=-1)
            probabilities = ordered.softmax(dim=-1)
            # drop a token once the likelier ones alone reach top_p (the likeliest always stays)
            dropped = probabilities.cumsum(dim=-1) - probabilities >= self.top_p
            scores = scores.scatter(-1, order, ordered.masked_fill(dropped, float("-inf")))
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=self.generator)


def greedy_decode(
    step: Any,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    max_cache_len: int,
    prompt_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    on_token: Callable[[torch.Tensor], None] | None = None,
    sampling: Sampling | None = None,
) -> torch.Tensor:
    """Greedy generation with a static-cache decode graph that takes a whole prompt and then
    one token per call.

    ``step(input_ids, valid, query_slots, position_ids) -> logits`` runs the graph and keeps its
    cache; ``valid[b, j]`` says whether cache slot ``j`` holds a real token and ``query_slots``
    are the slots the new tokens are written to (see :func:`decode_mask`). Returns
    ``[batch, prompt + new]`` token ids, like ``model.generate(do_sample=False)``: left padding
    (``prompt_mask``) is honoured and rows that produced an ``eos_token_id`` (one id or several) are
    padded with ``pad_token_id``. ``on_token(tokens)`` sees each new ``[batch, 1]`` column as it comes.

    A ``step`` with a ``reset()`` method (every target's decoder) is reset first: the graph writes
    at its cache's token counters, so one decoder serves any number of generations.

    ``sampling`` (a :class:`Sampling`) draws each token instead of taking the argmax.
    """
    batch, prompt_len = prompt_ids.shape
    if prompt_len + max_new_tokens > max_cache_len:
        raise HfExportError(
            f"prompt ({prompt_len}) + new tokens ({max_new_tokens}) exceed the cache length {max_cache_len}; "
            "ask for fewer new tokens or export with a larger max_cache_len"
        )
    stops = torch.tensor(
        [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    )
    prompt_mask = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask.long()
    if callable(reset := getattr(step, "reset", None)):
        reset()
    pick = sampling if sampling is not None else _last_argmax
    valid = torch.zeros(batch, max_cache_len, dtype=torch.long)
    valid[:, :prompt_len] = prompt_mask
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    logits = step(prompt_ids, valid, torch.arange(prompt_len), positions)
    tokens = [prompt_ids]
    finished = torch.zeros(batch, dtype=torch.bool)
    # between two steps the loop works on numpy views: with the caches cold after a step, each
    # torch operator's dispatch took tens of microseconds (SmolLM2 8da4w on ExecuTorch: the loop's
    # own time per step 0.66 ms with torch here and in decode_mask, 0.49 ms with numpy)
    written = valid.numpy()
    next_position = positions[:, -1:].numpy() + 1
    for index in range(max_new_tokens):
        next_token = pick(logits)
        if len(stops):
            next_token = torch.where(finished[:, None], torch.full_like(next_token, pad_token_id), next_token)
            finished |= torch.isin(next_token[:, 0], stops)
        tokens.append(next_token)
        if on_token is not None:
            on_token(next_token)
        if index == max_new_tokens - 1 or (len(stops) and bool(finished.all())):
            break
        slot = prompt_len + index
        written[:, slot] = 1
        logits = step(next_token, valid, torch.from_numpy(np.array([slot])), torch.from_numpy(next_position))
        next_position = next_position + 1
    return torch.cat(tokens, dim=1)


def _last_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``[batch, 1]``: the argmax of each row's last logits (numpy's, the first of equal maxima as
    torch's; torch's for a dtype numpy lacks)."""
    last = logits[:, -1]
    try:
        return torch.from_numpy(last.numpy().argmax(-1)[:, None])
    except (TypeError, RuntimeError):  # bfloat16, or a tensor that requires grad
        return last.argmax(-1, keepdim=True)


# --- text in, text out ---------------------------------------------------------------------------


@dataclass
class Generation:
    """What :meth:`~hfexport.text_generator.TextGenerator.generate` produced: the new token ids,
    their text, how fast, and why it stopped (``stop``: ``"end of sequence"``, ``"max_new_tokens"``
    or ``"cache full"``)."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    first_token_seconds: float  # prefill: from the call to the first new token
    decode_seconds: float  # every later token
    stop: str = "end of sequence"

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.first_token_seconds if self.first_token_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        later = len(self.tokens) - 1
        return later / self.decode_seconds if later > 0 and self.decode_seconds else 0.0

    def figures(self) -> str:
        """One line: prompt tokens, time to first token, prefill and decode speed."""
        return (
            f"prompt {self.prompt_tokens} tokens | first token in {self.first_token_seconds:.3f} s | "
            f"prefill {self.prefill_tokens_per_second:.1f} tok/s | decode {self.decode_tokens_per_second:.1f} tok/s "
            f"({len(self.tokens)} new tokens)"
        )


class TokenStream:
    """The ``on_token`` callback of a generation: collects the new tokens and their times, and
    passes ``stream`` each new piece of the decoded text as it grows (with a tokenizer)."""

    def __init__(self, tokenizer: Any, stream: Callable[[str], None] | None) -> None:
        self.tokenizer, self.stream = tokenizer, stream
        self.tokens: list[int] = []
        self.times: list[float] = []
        self._shown = ""

    def __call__(self, token: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(int(token[0, 0]))
        if self.stream is not None and self.tokenizer is not None:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.startswith(self._shown) and len(text) > len(self._shown):
                self.stream(text[len(self._shown) :])
                self._shown = text

    def generation(self, prompt_tokens: int, started: float, eos_token_ids: list[int], cache_full: bool) -> Generation:
        """The :class:`Generation` of the collected tokens, generation having started at ``started``."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        stop = (
            "end of sequence" if self.tokens[-1] in eos_token_ids else "cache full" if cache_full else "max_new_tokens"
        )
        first, last = self.times[0] - started, self.times[-1] - self.times[0]
        return Generation(self.tokens, text, prompt_tokens, first, last, stop)
