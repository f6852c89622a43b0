"""Built-in passes; importing this package registers them."""

from hfexport.passes import (  # noqa: F401
    attention,
    cache,
    cleanup,
    convolution,
    delegation,
    executorch_attention,
    moe,
    onnx_attention,
    onnx_graph,
    portable_kernels,
    quantize,
    rotary,
)
