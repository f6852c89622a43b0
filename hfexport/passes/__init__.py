"""Built-in passes; importing this package registers them."""

from hfexport.passes import cleanup  # noqa: F401
