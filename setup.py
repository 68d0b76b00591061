"""Builds the cpu backend's native kernel (deltarule/kernels/csrc/recurrent.c).

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
    "deltarule.kernels._recurrent_cpu",
    sources=["deltarule/kernels/csrc/recurrent.c", "deltarule/kernels/csrc/backward.c",
             "deltarule/kernels/csrc/conv.c"],
    depends=["deltarule/kernels/csrc/vector.h", "deltarule/kernels/csrc/elements.h",
             "deltarule/kernels/csrc/host_threads.h", "deltarule/kernels/csrc/fields.h"],
    extra_compile_args=["-O3", "-march=native", "-std=gnu11", "-pthread", "-Wno-psabi"],
    extra_link_args=["-pthread"],
    optional=True,
)])
