"""An example out-of-tree octavo platform: the template a hardware vendor copies.

It drives an imaginary "Example NPU". On machines without one it can be emulated on the CPU by
setting ``OCTAVO_EXAMPLE_NPU=1``; the kernels are octavo's reference kernels.
"""
