"""Built-in passes; importing this package registers them."""

from hfexport.passes import attention, cache, cleanup, convolution, moe, onnx_graph, portable_kernels  # noqa: F401
