"""Multimodal models' per-image loops written so the number of images stays symbolic
(``hfexport.models.per_image``): the same numbers as transformers' code, and programs that take
another number of images than their sample's."""

import pytest
import torch
from transformers.vision_utils import (
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

from hfexport.models.per_image import (
    SplitPieces,
    interpolation_indices_and_weights,
    position_ids_per_token,
    window_index_per_token,
)
from hfexport.pipeline.patches import patches_applied

SPLIT_PATCHES = ["per_image_sizes_made_when_read", "split_by_sizes_made_when_read", "cat_of_a_deferred_split"]


@pytest.mark.parametrize("merge", [1, 2])
@pytest.mark.parametrize("temporal", [False, True])
def test_position_ids_per_token_are_transformers_own(merge, temporal):
    grid = torch.tensor([[1, 4, 6], [2, 2, 2], [3, 6, 4]])
    expected = get_vision_position_ids(grid, merge, include_temporal=temporal)
    assert torch.equal(position_ids_per_token(grid, merge, temporal), expected)
    per_image = torch.tensor([2, 1, 2])  # a merge size per image
    assert torch.equal(position_ids_per_token(grid, per_image), get_vision_position_ids(grid, per_image))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("merge", [1, 2])
@pytest.mark.parametrize("align_corners", [False, True])
def test_interpolation_indices_and_weights_are_transformers_own(mode, merge, align_corners):
    grid = torch.tensor([[1, 4, 6], [2, 2, 2], [3, 6, 4]])
    for padding in ("border", "zeros"):
        expected = get_vision_interpolation_indices_and_weights(grid, 5, mode, align_corners, merge, padding)
        got = interpolation_indices_and_weights(grid, 5, mode, align_corners, merge, padding)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("grid", [[[1, 4, 6], [2, 2, 2], [3, 6, 4]], [[1, 16, 12], [1, 4, 4]], [[2, 10, 14]]])
@pytest.mark.parametrize(("merge", "window", "patch"), [(2, 112, 14), (2, 56, 14), (1, 28, 14)])
def test_window_index_per_token_is_transformers_own(grid, merge, window, patch):
    # windows that fill the image exactly (transformers pads them with an empty window row) and not
    grid = torch.tensor(grid)
    expected_index, expected_bounds = get_vision_window_index(grid, merge, window, patch)
    index, bounds = window_index_per_token(grid, merge, window, patch)
    assert torch.equal(index, expected_index)
    assert torch.equal(bounds, expected_bounds) and bounds.dtype == expected_bounds.dtype


class SplitAndConcatenate(torch.nn.Module):
    """Qwen2-VL's pattern: get_image_features splits the features per image by sizes from
    .tolist(), the forward concatenates them again and returns the pieces too."""

    def get_image_features(self, features: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(features, grid.prod(-1).tolist())

    def forward(self, features: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        pieces = self.get_image_features(features, grid)
        return torch.cat(pieces, dim=0) * 2, pieces


def _sample(images: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([[1, 2, 2 + i] for i in range(images)])
    return torch.randn(int(grid.prod(-1).sum()), 4), grid


def test_a_split_concatenated_again_leaves_the_number_of_images_symbolic():
    # before: .tolist() fixed the number of images to the sample's ("specialized it to be a constant (2)")
    model = SplitAndConcatenate()
    dims = ({0: torch.export.Dim.AUTO}, {0: torch.export.Dim.AUTO})
    with patches_applied(SPLIT_PATCHES):
        program = torch.export.export(model, _sample(2), dynamic_shapes=dims, strict=False)
    features, grid = _sample(3)
    doubled, pieces = program.module()(features, grid)
    expected_doubled, expected_pieces = model(features, grid)
    torch.testing.assert_close(doubled, expected_doubled, atol=0, rtol=0)
    assert isinstance(pieces, SplitPieces) and len(pieces) == 3  # eager's pieces again
    for got, expected in zip(pieces, expected_pieces, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_pieces_that_are_read_are_made_as_before():
    class ReadsThePieces(torch.nn.Module):
        def get_image_features(self, features: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            sizes = grid.prod(-1).tolist()
            assert len(sizes) == grid.shape[0]  # a read: the list is made
            return torch.stack([piece.sum(0) for piece in torch.split(features, sizes)])

        def forward(self, features: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            return self.get_image_features(features, grid)

    model = ReadsThePieces()
    sample = _sample(2)
    with patches_applied(SPLIT_PATCHES):
        program = torch.export.export(model, sample, strict=False)
    torch.testing.assert_close(program.module()(*sample), model(*sample), atol=1e-6, rtol=1e-6)


def test_every_other_cat_call_goes_through_as_it_came():
    # Funnel writes torch.cat([...], axis=axis): the patched cat passed dim and axis both (TypeError)
    first, second = torch.randn(2, 3), torch.randn(2, 5)
    with patches_applied(SPLIT_PATCHES):
        by_axis = torch.cat([first, second], axis=1)
        by_keywords = torch.cat(tensors=[first, second], dim=-1)
        into = torch.empty(2, 8)
        torch.cat((first, second), 1, out=into)
    expected = torch.cat([first, second], dim=1)
    for got in (by_axis, by_keywords, into):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
