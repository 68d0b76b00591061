"""Builds the cpu backend's native kernel (deltarule/kernels/csrc/recurrent.c).

Plain C with POSIX threads, compiled for the machine that installs it (-march=native:
the kernel's 16-float vectors become AVX-512 where the CPU has it). The
extension is optional: without a C compiler the install still succeeds and
`deltarule.backend_info()` reports the cpu backend as unavailable.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "deltarule.kernels._recurrent_cpu",
    sources=["deltarule/kernels/csrc/recurrent.c"],
    extra_compile_args=["-O3", "-march=native", "-std=gnu11", "-pthread", "-Wno-psabi"],
    extra_link_args=["-pthread"],
    optional=True,
)])
