"""Multimodal models whose number of images stays a symbolic axis.

Qwen2-VL-style models (Qwen2/2.5/3-VL, GLM-4V, MiniMax-M3-VL, ...) take every image's patches
packed in one ``pixel_values`` and their grids in ``image_grid_thw``, one row per image. Three
places in transformers fix the number of rows to the sample's while tracing:

- ``vision_utils.get_vision_position_ids`` and ``get_vision_window_index`` (Qwen2.5-VL's windowed
  attention) loop over ``grid_thw.tolist()``, and ``get_vision_interpolation_indices_and_weights``
  slices a one-element ``cumsum[:-1]`` for a two-image sample; computed per token
  (:func:`position_ids_per_token`, :func:`window_index_per_token`,
  :func:`interpolation_indices_and_weights`), none fixes it.
- ``get_image_features`` splits the encoder's output per image with sizes from ``.tolist()``, and
  the forward concatenates the pieces again. During capture, ``.tolist()`` of a 1-D integer tensor
  of symbolic length in a ``get_<modality>_features`` method gives a :class:`LazySizes` list, made
  (and its length fixed, as before) only when something reads it; a split by it gives a
  :class:`DeferredSplit`, whose ``torch.cat`` is the tensor itself. Returned as an output
  (``image_outputs.pooler_output``), a deferred split is two outputs of the program,
  ``<path>.concatenated`` and ``<path>.split_sizes``; the program's outputs unflattened
  (``ExportedProgram.module()``) and hfexport's runners give eager's pieces again.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hfexport.pipeline.patches import register_patch

# Split and concatenated per image, the count fixed by the list: pytorch/pytorch#158786 (data-dependent
# sizes from .tolist()); a Python loop over a symbolic count cannot be traced
UPSTREAM = "https://github.com/pytorch/pytorch/issues/158786"
FEATURES_METHOD = re.compile(r"get_\w+_features")


def position_ids_per_token(
    grid_thw: torch.Tensor, spatial_merge_size: int | torch.Tensor, include_temporal: bool = False
) -> torch.Tensor:
    """``transformers.vision_utils.get_vision_position_ids``' result computed per token: each
    token's image (``repeat_interleave`` of the images' token counts), frame and place in its
    image's ``m x m``-block-major layout, with no loop over the images."""
    grid = grid_thw.to(torch.long)
    frames, height, width = grid.unbind(-1)
    merge = torch.as_tensor(spatial_merge_size, dtype=torch.long, device=grid.device).expand(grid.shape[0])
    sizes = frames * height * width
    image = torch.repeat_interleave(torch.arange(grid.shape[0], device=grid.device), sizes)  # per token
    token = torch.arange(image.shape[0], device=grid.device)
    local = token - (sizes.cumsum(0) - sizes)[image]
    frame_size = (height * width)[image]
    m, blocks_wide = merge[image], (width // merge)[image]
    within = local % frame_size
    column, row = within % m, (within // m) % m
    block = within // (m * m)
    hpos, wpos = (block // blocks_wide) * m + row, (block % blocks_wide) * m + column
    if include_temporal:
        return torch.stack([local // frame_size, hpos, wpos], dim=-1)
    return torch.stack([hpos, wpos], dim=-1)


def _precomputed(kwargs: dict | None, *names: str) -> tuple | None:
    """The values ``names`` a caller computed already and handed in ``kwargs`` (as transformers'
    vision helpers take them; hfexport's generation encoders take them as inputs), popped from it;
    ``None`` unless every one is there."""
    if kwargs is None:
        return None
    values = tuple(kwargs.pop(name, None) for name in names)
    return None if any(value is None for value in values) else values


@register_patch(
    "transformers.models.*.modeling_*:get_vision_position_ids",
    name="vision_position_ids_per_token",
    reason="get_vision_position_ids loops over grid_thw.tolist(), fixing the number of images to the sample's",
    upstream=UPSTREAM,
)
def _vision_position_ids_per_token(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_vision_position_ids(
        grid_thw: torch.Tensor,
        spatial_merge_size: int | torch.Tensor,
        include_temporal: bool = False,
        kwargs: dict | None = None,
    ) -> torch.Tensor:
        if (given := _precomputed(kwargs, "position_ids")) is not None:
            return given[0]
        return position_ids_per_token(grid_thw, spatial_merge_size, include_temporal)

    return get_vision_position_ids


def interpolation_indices_and_weights(
    grid_thw: torch.Tensor,
    num_grid_per_side: int,
    mode: str = "bilinear",
    align_corners: bool = False,
    spatial_merge_size: int = 1,
    padding: str = "border",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers.vision_utils.get_vision_interpolation_indices_and_weights``' result with each
    patch's row and column from :func:`position_ids_per_token`: the helper's own per-image starts
    slice ``cumsum[:-1]``, one element long for a two-image sample, which the trace fixes (its
    contiguity check asks whether the length is below 2)."""
    from transformers.vision_utils import _interpolation_axis_taps_weights

    grid = grid_thw.to(torch.long)
    row, col = position_ids_per_token(grid, spatial_merge_size).unbind(-1)
    image = torch.repeat_interleave(torch.arange(grid.shape[0], device=grid.device), grid.prod(-1))
    heights, widths = grid[:, 1][image], grid[:, 2][image]
    side = num_grid_per_side
    h_taps, h_weights = _interpolation_axis_taps_weights(row, heights, side, mode, align_corners, padding)
    w_taps, w_weights = _interpolation_axis_taps_weights(col, widths, side, mode, align_corners, padding)
    n = h_taps.shape[1]
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, n * n)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, n * n)
    return indices, weights


@register_patch(
    "transformers.models.*.modeling_*:get_vision_interpolation_indices_and_weights",
    name="vision_interpolation_per_token",
    reason=(
        "get_vision_interpolation_indices_and_weights slices cumsum[:-1]: for a two-image sample one element, "
        "whose contiguity check fixes the number of images to 2 (Qwen3-VL's position-embedding interpolation)"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/151582",
)
def _vision_interpolation_per_token(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_vision_interpolation_indices_and_weights(
        grid_thw: torch.Tensor,
        num_grid_per_side: int,
        mode: str = "bilinear",
        align_corners: bool = False,
        spatial_merge_size: int = 1,
        padding: str = "border",
        kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (given := _precomputed(kwargs, "interp_indices", "interp_weights")) is not None:
            return given
        return interpolation_indices_and_weights(
            grid_thw, num_grid_per_side, mode, align_corners, spatial_merge_size, padding
        )

    return get_vision_interpolation_indices_and_weights


def window_index_per_token(
    grid_thw: torch.Tensor, spatial_merge_size: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers.vision_utils.get_vision_window_index``' result computed per merged token:
    the windows' order is the argsort of each token's (image, frame, window, place in window), and
    the windows' boundaries are where that order moves to the next window, so no window is empty
    (the helper's ``unique_consecutive`` drops the empty ones)."""
    grid = grid_thw.to(torch.long)
    frames, height, width = grid.unbind(-1)
    side = window_size // spatial_merge_size // patch_size  # merged tokens per window side
    rows, cols = height // spatial_merge_size, width // spatial_merge_size
    windows_high, windows_wide = (rows + side - rows % side) // side, (cols + side - cols % side) // side
    tokens, windows = frames * rows * cols, frames * windows_high * windows_wide
    image = torch.repeat_interleave(torch.arange(grid.shape[0], device=grid.device), tokens)
    local = torch.arange(image.shape[0], device=grid.device) - (tokens.cumsum(0) - tokens)[image]
    frame_size, row_length, wide = (rows * cols)[image], cols[image], windows_wide[image]
    frame, within = local // frame_size, local % frame_size
    row, col = within // row_length, within % row_length
    window = (windows.cumsum(0) - windows)[image] + (frame * windows_high[image] + row // side) * wide + col // side
    window_index = torch.argsort(window * side * side + (row % side) * side + col % side)
    ordered = window[window_index]
    starts = torch.cat([ordered.new_ones(1, dtype=torch.bool), ordered[1:] != ordered[:-1]]).nonzero().squeeze(1)
    ends = torch.cat([starts, starts.new_full((1,), ordered.shape[0])])
    return window_index, (ends * spatial_merge_size**2).to(torch.int32)


@register_patch(
    "transformers.models.*.modeling_*:get_vision_window_index",
    name="vision_window_index_per_token",
    reason="get_vision_window_index loops over grid_thw.tolist(), building each image's windows from its sizes",
    upstream=UPSTREAM,
)
def _vision_window_index_per_token(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_vision_window_index(
        grid_thw: torch.Tensor, spatial_merge_size: int, window_size: int, patch_size: int, kwargs: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (given := _precomputed(kwargs, "window_index", "cu_window_seqlens")) is not None:
            return given
        return window_index_per_token(grid_thw, spatial_merge_size, window_size, patch_size)

    return get_vision_window_index


class _UnmadeSizes(list):
    def __init__(self, sizes: torch.Tensor, tolist: Callable[[torch.Tensor], list]) -> None:
        super().__init__()
        self.sizes, self._tolist, self.made = sizes, tolist, False

    def make(self) -> _UnmadeSizes:
        if not self.made:
            self.made = True
            super().extend(self._tolist(self.sizes))
        return self


def _reading(name: str) -> Callable:
    method = getattr(list, name)

    def read(self: _UnmadeSizes, *args: Any, **kwargs: Any) -> Any:
        return method(self.make(), *args, **kwargs)

    return read


_LIST_READS = (
    "__iter__ __len__ __getitem__ __contains__ __repr__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __add__ __mul__ "
    "__rmul__ __reversed__ __setitem__ __delitem__ __iadd__ __imul__ append extend insert pop remove index count "
    "copy sort reverse clear"
).split()
LazySizes = type(
    "LazySizes",
    (_UnmadeSizes,),
    {
        "__doc__": """``.tolist()`` of a 1-D integer tensor of symbolic length, made only when read (then as
        the original ``tolist`` makes it, fixing the length): every list method makes it first.""",
        "__module__": __name__,
        **{name: _reading(name) for name in _LIST_READS},
    },
)


class DeferredSplit:
    """``tensor.split(sizes, dim)`` by :class:`LazySizes`, not made yet: ``torch.cat`` of it along
    ``dim`` is ``tensor``; reading it makes the pieces."""

    def __init__(self, tensor: torch.Tensor, sizes: _UnmadeSizes, dim: int, split: Callable) -> None:
        self.tensor, self.sizes, self.dim, self._split = tensor, sizes, dim, split
        self._pieces: tuple[torch.Tensor, ...] | None = None

    def pieces(self) -> tuple[torch.Tensor, ...]:
        if self._pieces is None:
            self._pieces = tuple(self._split(self.tensor, self.sizes.make(), self.dim))
        return self._pieces

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.pieces())

    def __len__(self) -> int:
        return len(self.pieces())

    def __getitem__(self, index: Any) -> Any:
        return self.pieces()[index]


class SplitPieces(tuple):
    """A program's per-image output (returned as :data:`CONCATENATED` and :data:`SPLIT_SIZES`)
    split again: eager's pieces, a tuple."""

    tensor: torch.Tensor
    sizes: torch.Tensor


CONCATENATED, SPLIT_SIZES = "concatenated", "split_sizes"  # a deferred split's output names


def _flatten(split: DeferredSplit) -> tuple[list[torch.Tensor], int]:
    return [split.tensor, split.sizes.sizes], split.dim


def _flatten_with_keys(split: DeferredSplit) -> tuple[list[tuple[Any, torch.Tensor]], int]:
    keys = (pytree.GetAttrKey(CONCATENATED), pytree.GetAttrKey(SPLIT_SIZES))
    return list(zip(keys, _flatten(split)[0], strict=True)), split.dim


def _unflatten(children: list[Any], dim: int) -> Any:
    """Eager's pieces for real outputs; inside a trace (a lowering retracing the program, or the
    placeholder leaves that name its outputs) the split stays deferred, so it flattens back into
    the same two leaves."""
    tensor, sizes = children
    if type(sizes) is not torch.Tensor or sizes.numel() == 0:
        return DeferredSplit(tensor, LazySizes(sizes, torch.Tensor.tolist), dim, torch.Tensor.split)
    pieces = SplitPieces(torch.split(tensor, [int(s) for s in sizes.tolist()], dim))
    pieces.tensor, pieces.sizes = tensor, sizes
    return pieces


pytree.register_pytree_node(
    DeferredSplit,
    _flatten,
    _unflatten,
    serialized_type_name=f"{__name__}.DeferredSplit",
    flatten_with_keys_fn=_flatten_with_keys,
)
pytree.register_pytree_node(
    SplitPieces,
    lambda pieces: (list(pieces), None),
    lambda children, _: tuple(children),
    serialized_type_name=f"{__name__}.SplitPieces",
    flatten_with_keys_fn=lambda pieces: ([(pytree.SequenceKey(i), p) for i, p in enumerate(pieces)], None),
)


def pieces_by_path(found: dict[str, Any]) -> dict[str, Any]:
    """A runtime's outputs by path with each per-image output (``<path>.concatenated`` and
    ``<path>.split_sizes``) split again into eager's ``<path>.0``, ``<path>.1``, …"""
    suffix = f".{CONCATENATED}"
    merged = [path.removesuffix(suffix) for path in found if path.endswith(suffix)]
    if not merged:
        return found
    result = dict(found)
    for path in merged:
        sizes = result.pop(f"{path}.{SPLIT_SIZES}", None)
        if sizes is None:
            continue
        tensor = torch.as_tensor(result.pop(f"{path}{suffix}"))
        pieces = torch.split(tensor, [int(s) for s in torch.as_tensor(sizes).tolist()])
        result.update({f"{path}.{i}": piece for i, piece in enumerate(pieces)})
    return result


@register_patch(
    "torch._subclasses.fake_tensor:FakeTensor.tolist",
    name="per_image_sizes_made_when_read",
    reason=(
        "get_image_features splits the image features per image by sizes from .tolist() and the forward "
        "concatenates them again; the list fixes the number of images. Of a 1-D integer tensor of symbolic "
        "length it is made only when read (split_by_sizes_made_when_read defers a split by it)"
    ),
    upstream=UPSTREAM,
)
def _per_image_sizes_made_when_read(original: Callable) -> Callable:
    @functools.wraps(original)
    def tolist(self: torch.Tensor) -> Any:
        # only where the per-image split is made: a modality's feature method (get_image_features,
        # get_video_features); elsewhere the list is made at once, as the original makes it
        split_sizes = FEATURES_METHOD.fullmatch(sys._getframe(1).f_code.co_name) is not None
        if split_sizes and self.dim() == 1 and isinstance(self.shape[0], torch.SymInt) and not self.is_floating_point():
            return LazySizes(self, original)
        return original(self)

    return tolist


@register_patch(
    "torch:Tensor.split",
    name="split_by_sizes_made_when_read",
    reason="a split by sizes not made yet is deferred: concatenated again it is the tensor, with no count fixed",
    upstream=UPSTREAM,
)
def _split_by_sizes_made_when_read(original: Callable) -> Callable:
    @functools.wraps(original)
    def split(self: torch.Tensor, split_size: Any, dim: int = 0) -> Any:
        if isinstance(split_size, LazySizes) and not split_size.made:
            return DeferredSplit(self, split_size, dim, original)
        return original(self, split_size, dim)

    return split


@register_patch(
    "torch:cat",
    name="cat_of_a_deferred_split",
    reason="torch.cat of a deferred split along its axis is the tensor that was split",
    upstream=UPSTREAM,
)
def _cat_of_a_deferred_split(original: Callable) -> Callable:
    @functools.wraps(original)
    def cat(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # every other call goes through as it came (torch.cat also takes its axis as ``axis=``: Funnel)
        if isinstance(tensors, DeferredSplit) and tensors._pieces is None:
            dim = args[0] if args else kwargs.get("dim", kwargs.get("axis", 0))
            rank = tensors.tensor.dim()
            if isinstance(dim, int) and dim % rank == tensors.dim % rank:
                return original([tensors.tensor], *args, **kwargs)
        return original(tensors, *args, **kwargs)

    return cat


@register_patch(
    "transformers.models.llava.modeling_*:LlavaModel.get_image_features",
    name="llava_image_features_split_when_read",
    reason=(
        "LLaVA's get_image_features returns list(image_features), one piece per image, which its forward "
        "concatenates again: the list fixes the number of images to the sample's (Eq(s99, 2)). The projector's "
        "rows of every image are returned as a deferred split, one piece per image when read"
    ),
    upstream=UPSTREAM,
)
def _llava_image_features_split_when_read(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_image_features(self: torch.nn.Module, pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes_given = (len(args) >= 3 and args[2] is not None) or kwargs.get("image_sizes") is not None
        if sizes_given or isinstance(pixel_values.shape[0], int):
            return original(self, pixel_values, *args, **kwargs)
        # one piece holding every image's rows, so that list() of it has one item
        handle = self.multi_modal_projector.register_forward_hook(
            lambda module, inputs, output: output.reshape(1, -1, output.shape[-1])
        )
        try:
            outputs = original(self, pixel_values, *args, **kwargs)
        finally:
            handle.remove()
        (rows,) = outputs.pooler_output
        images = pixel_values.shape[0]
        sizes = torch.ones(images, dtype=torch.long, device=rows.device) * (rows.shape[0] // images)
        outputs.pooler_output = DeferredSplit(rows, LazySizes(sizes, torch.Tensor.tolist), 0, torch.Tensor.split)
        return outputs

    return get_image_features


@register_patch(
    "transformers.models.pixtral.modeling_*:PixtralVisionModel.forward",
    name="pixtral_images_of_one_size_without_a_loop",
    reason=(
        "Pixtral's vision encoder cuts, flattens and positions each image in Python loops over the batch, "
        "fixing the number of images to the sample's; images given without sizes all have the batch's size, "
        "so the same sequence, positions and block mask are made for any number of them"
    ),
    upstream=UPSTREAM,
)
def _pixtral_images_of_one_size_without_a_loop(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self: torch.nn.Module, pixel_values: torch.Tensor, image_sizes: Any = None, **kwargs: Any) -> Any:
        if image_sizes is not None or kwargs or isinstance(pixel_values.shape[0], int):
            return original(self, pixel_values, image_sizes, **kwargs)
        embeds = self.patch_conv(pixel_values.to(dtype=self.patch_conv.weight.dtype))  # (images, dim, h, w)
        images, dim, height, width = embeds.shape
        patch_embeds = self.ln_pre(embeds.flatten(2).transpose(1, 2).reshape(1, -1, dim))
        rows, columns = torch.meshgrid(
            torch.arange(height, device=embeds.device), torch.arange(width, device=embeds.device), indexing="ij"
        )
        position_ids = torch.stack([rows.flatten(), columns.flatten()], dim=-1).repeat(images, 1)
        position_embeddings = self.patch_positional_embedding(patch_embeds, position_ids)
        image = torch.arange(patch_embeds.shape[1], device=embeds.device) // (height * width)
        dtype = patch_embeds.dtype
        mask = torch.where(image[:, None] == image[None, :], 0.0, torch.finfo(dtype).min).to(dtype)
        return self.transformer(patch_embeds, attention_mask=mask[None, None], position_embeddings=position_embeddings)

    return forward
