"""Compiled attention kernels, optional: imported only when selected (``pagedkv.attention.set_kernel``).

Each kernel reads low-precision pages as stored and decodes them inside its dot products. It
imports nothing of pagedkv beyond the errors, and its compiler (numba, the ``jit`` extra) only
when first called, so ``import pagedkv`` stays numpy-only. vLLM: ``csrc/attention`` (CUDA);
here CPU code through LLVM. Measurements: docs/quantization.md, ``benchmarks/bench_formats.py``.
"""
