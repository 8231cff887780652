"""Benchmarks of the Little Horse kernels; each module runs as ``python -m bench.<name>``."""
