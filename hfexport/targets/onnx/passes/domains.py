"""The operator domains the ONNX passes write nodes in."""

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators (MatMulNBits, GroupQueryAttention, …)
