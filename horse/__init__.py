"""Little Horse: drop-in fused layers (``horse.layers``) built on the Triton kernels of ``kernels``."""
