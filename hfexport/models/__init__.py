"""What hfexport knows about transformers: the capture frontend, cache pytrees, the generation
decomposition, windowed static-cache layers, vision-encoder inputs, per-image loops over a symbolic
number of images and the model patches.
Importing this package registers its patches."""

from hfexport.models import patches, per_image, static_layers, vision  # noqa: F401  (register their patches)
from hfexport.models.frontend import TRANSFORMERS, TransformersFrontend

__all__ = ["TRANSFORMERS", "TransformersFrontend"]
