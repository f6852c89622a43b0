"""Exception classes. Every error says what went wrong and what to do about it."""

from __future__ import annotations


class HfExportError(Exception):
    """Base class of every error hfexport raises on purpose."""


class ConfigError(HfExportError, ValueError):
    """A config, config key, export format or pass name is not valid."""


class UnsupportedModelError(HfExportError):
    """The model is set up in a way no exporter supports (e.g. its attention implementation)."""


class CaptureError(HfExportError):
    """``torch.export`` failed to capture the model."""


class PassOrderError(HfExportError):
    """A pass list breaks an ordering constraint declared by one of its passes."""


class PassError(HfExportError):
    """A pass raised or left the program in an invalid state."""


class StageError(HfExportError):
    """A pipeline stage (capture, lowering, …) failed."""


class VerificationError(HfExportError):
    """A stage's outputs differ from eager PyTorch beyond the tolerance."""
