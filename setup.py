"""Builds the cpu backend's native kernel (deltarule/kernels/cpu/csrc/recurrent.c).

Plain C with POSIX threads (at run time it runs on torch's OpenMP threads too, whose entry
points the binding hands it: no OpenMP at build time), compiled for the machine that
installs it (-march=native: 16-float AVX-512 vectors where the CPU has AVX-512, else
8-float AVX2 ones;
`CFLAGS=-DDELTARULE_VEC=16 pip install --no-build-isolation -e .` builds the
16-float configuration anywhere, for testing it). The extension is optional:
without a C compiler the install still succeeds and `deltarule.backend_info()`
reports the cpu backend as unavailable (a failed build of an edited kernel
keeps the previous .so: compile it with gcc -c first).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "deltarule.kernels.cpu._native",
    sources=["deltarule/kernels/cpu/csrc/recurrent.c", "deltarule/kernels/cpu/csrc/backward.c",
             "deltarule/kernels/cpu/csrc/conv.c", "deltarule/kernels/cpu/csrc/replay.c",
             "deltarule/kernels/cpu/csrc/team.c"],
    depends=["deltarule/kernels/cpu/csrc/vector.h", "deltarule/kernels/cpu/csrc/elements.h",
             "deltarule/kernels/cpu/csrc/team.h", "deltarule/kernels/cpu/csrc/fields.h"],
    extra_compile_args=["-O3", "-march=native", "-std=gnu11", "-pthread", "-Wno-psabi"],
    extra_link_args=["-pthread"],
    optional=True,
)])
