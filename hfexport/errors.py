"""Exception classes. Every error says what went wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Sequence


class HfExportError(Exception):
    """Base class of every error hfexport raises on purpose."""


class ConfigError(HfExportError, ValueError):
    """A config, config key, export format or pass name is not valid."""


class UnsupportedModelError(HfExportError):
    """The model is set up in a way no exporter supports (e.g. its attention implementation)."""


class RuntimeInterfaceError(UnsupportedModelError):
    """A model's generation cannot be given a runtime's own interface (ONNX Runtime GenAI's, ExecuTorch's LLM
    runner's): it needs an input that runtime does not feed, or components besides one decode graph. hfexport's
    own interface (``genai=False`` / ``llm_runner=False``, the command line's ``--spec-io``) still exports it."""


class CaptureError(HfExportError):
    """``torch.export`` failed to capture the model."""


class PassOrderError(HfExportError):
    """A pass list breaks an ordering constraint declared by one of its passes."""


class PassError(HfExportError):
    """A pass raised or left the program in an invalid state. ``pass_name``, ``passes_before``
    and ``cause`` (the underlying error as text) say which pass failed, after which, and how."""

    pass_name: str = ""
    passes_before: tuple[str, ...] = ()
    cause: str = ""

    @classmethod
    def of(cls, pass_name: str, passes_before: Sequence[str], error: BaseException) -> PassError:
        if isinstance(error, PassError):
            return error
        cause = f"{type(error).__name__}: {error}"
        before = ", ".join(passes_before) or "none"
        instance = cls(f"pass {pass_name!r} failed ({cause}); passes before it: {before}")
        instance.pass_name, instance.passes_before, instance.cause = pass_name, tuple(passes_before), cause
        return instance


class ArtifactError(HfExportError):
    """A saved artifact cannot be read: missing, truncated or corrupt, or (without ``trust``) it
    would run code from the file when loaded; or an artifact cannot be written as it was exported."""


class StageError(HfExportError):
    """A pipeline stage (capture, lowering, …) failed."""


class VerificationError(HfExportError):
    """A stage's outputs differ from eager PyTorch beyond the tolerance."""
