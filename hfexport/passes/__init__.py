"""Built-in passes; importing this package registers them."""

from hfexport.passes import cleanup, moe, onnx_graph  # noqa: F401
