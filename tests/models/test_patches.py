"""Patches of torch modules for capture: each numerically equal to the module it replaces, and the
captured program takes other shapes."""

import pytest
import torch

import hfexport.models  # noqa: F401  registers the patches
from hfexport.pipeline.patches import patches_applied


@pytest.mark.parametrize(
    "options",
    [
        {"batch_first": True},
        {"num_layers": 2, "bidirectional": True},
        {"batch_first": True, "bidirectional": True, "bias": False},
    ],
)
def test_an_lstm_exports_for_any_sequence_length(options):
    # torch.export unrolls nn.LSTM over the sample's time steps: the program took that length only
    # (Parakeet's transducer predictor); as a scan it takes any
    lstm = torch.nn.LSTM(8, 6, **options).eval()
    time_axis = 1 if options.get("batch_first") else 0

    def sample(batch, steps):
        shape = [batch, steps, 8] if time_axis == 1 else [steps, batch, 8]
        return torch.randn(*shape)

    x = sample(2, 5)
    with patches_applied(["lstm_as_scan_op"]):
        patched = lstm(x)
        program = torch.export.export(
            lstm, (x,), dynamic_shapes=({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
        )
    eager = lstm(x)
    for got, expected in zip((patched[0], *patched[1]), (eager[0], *eager[1]), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    longer = sample(3, 9)
    torch.testing.assert_close(program.module()(longer)[0], lstm(longer)[0], atol=1e-6, rtol=1e-5)


def test_an_lstm_with_a_given_state_or_unbatched_input_matches():
    lstm = torch.nn.LSTM(8, 6).eval()
    x, state = torch.randn(5, 8), (torch.randn(1, 6), torch.randn(1, 6))
    with patches_applied(["lstm_as_scan_op"]):
        output, (h, c) = lstm(x, state)
    expected, (h_expected, c_expected) = lstm(x, state)
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h, h_expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(c, c_expected, atol=1e-6, rtol=1e-5)
