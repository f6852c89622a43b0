"""whole_input_convolutions_as_linear: only convolutions with one output position are rewritten."""

import torch
from graphs import count

from hfexport import get_pass


class PatchEmbeddings(torch.nn.Module):
    """Qwen2-VL's patch embedding: one flattened patch per row, a 3-D kernel covering it."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False)
        self.image = torch.nn.Conv2d(3, 8, kernel_size=2, stride=2, bias=True)  # slides: left alone

    def forward(self, patches, image):
        embedded = self.proj(patches.view(-1, 3, 2, 4, 4)).view(-1, 8)
        return embedded, self.image(image)


def test_only_whole_input_convolutions_become_linear():
    patches, image = torch.randn(5, 96), torch.randn(1, 3, 8, 8)
    program = torch.export.export(PatchEmbeddings(), (patches, image))
    expected = program.module()(patches, image)
    result = get_pass("whole_input_convolutions_as_linear")(program)
    assert result.counts == {"rewritten": 1}
    assert count(result.program, torch.ops.aten.conv3d.default) == 0
    assert count(result.program, torch.ops.aten.conv2d.default) == 1
    assert count(result.program, torch.ops.aten.linear.default) == 1
    for got, want in zip(result.program.module()(patches, image), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
