"""The target-neutral passes (FX passes on the captured program that any target may list);
importing this package registers them. A target's own passes live in
``hfexport/targets/<target>/passes/``, beside its default pass lists."""

from hfexport.passes import (  # noqa: F401
    attention,
    cache,
    cleanup,
    convolution,
    moe,
    quantize,
    rotary,
)

# the cleanups every target's default list starts with
CLEANUP_PASSES = (
    "remove_tensor_metadata_asserts",
    "remove_noop_conversions",
    "remove_noop_squeezes",
    "mark_cache_mutations",
)
