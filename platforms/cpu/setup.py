"""Builds the cpu platform's compiled kernels (C++ through torch.utils.cpp_extension), one
library per instruction set: ``_C_avx512`` (AVX-512 with BF16 and VNNI) and ``_C_avx2`` (AVX2 +
FMA). At run time ``octavo_cpu.kernels`` loads the best one the CPU supports. A build that fails (no
compiler, an old assembler) is skipped with a warning: the platform then runs its torch path,
and ``octavo env`` says so."""

from __future__ import annotations

import os
import sys

from setuptools import setup

ISA_FLAGS = {
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512bf16",
        "-mavx512vnni",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX512",  # ATen's vector types (at::vec) for this ISA
        "-DCPU_CAPABILITY_AVX512",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
SOURCES = [
    "csrc/paged_attention.cpp",
    "csrc/activation.cpp",
    "csrc/rms_norm.cpp",
    "csrc/rotary.cpp",
    "csrc/gemm.cpp",
    "csrc/argmax.cpp",
    "csrc/decoder_stack.cpp",
    "csrc/draft_head.cpp",
    "csrc/quantized_gemm.cpp",
    "csrc/lora.cpp",
    "csrc/fused_moe.cpp",
    "csrc/mla_attention.cpp",
]


def _extensions():
    if os.environ.get("OCTAVO_CPU_NO_BUILD") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # no torch at build time: the torch path is all there is
        print(
            "octavo-cpu: torch is not importable at build time; no compiled kernels",
            file=sys.stderr,
        )
        return [], {}

    class OptionalBuild(BuildExtension):
        """Builds what it can: a failed library is skipped, the install goes on."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the torch path
                print(f"octavo-cpu: skipping {ext.name} ({exc})", file=sys.stderr)

    extensions = [
        CppExtension(
            name=f"octavo_cpu._C_{isa}",
            sources=SOURCES,
            extra_compile_args=[
                "-O3",
                "-fopenmp",
                "-ffp-contract=fast",
                "-fno-math-errno",
                f"-DOCTAVO_CPU_NAMESPACE=octavo_cpu_{isa}",
                *flags,
            ],
            extra_link_args=["-fopenmp"],
        )
        for isa, flags in ISA_FLAGS.items()
    ]
    return extensions, {"build_ext": OptionalBuild.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
