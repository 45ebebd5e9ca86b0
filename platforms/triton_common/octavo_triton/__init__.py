"""Triton kernels shared by octavo's GPU platforms.

The cuda and rocm plugins both build on these kernels; each chooses its own launch tuning
(:mod:`octavo_triton.tuning`) and may replace a kernel with a chip-specific one. The package is a
library, not a plugin: it registers no entry point.
"""
