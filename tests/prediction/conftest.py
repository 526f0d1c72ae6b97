"""Tests of the prediction layer. This folder holds ``_tiny_hf`` (tiny transformers configs),
which the tests in models/ and tracing/ import: pytest's default ``prepend`` import mode puts a
conftest's folder on ``sys.path`` before it collects the tests below it."""
