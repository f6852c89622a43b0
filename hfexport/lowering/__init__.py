"""Lowering stages, one module per target; each imports its backend packages itself."""
