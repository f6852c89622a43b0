"""The machinery: capture, passes and their executor, rewrite rules, instruments, patches, the
pipeline. It knows no model library and no target (tests/test_package.py checks its imports)."""
