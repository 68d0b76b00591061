"""Kernels that only compute, one folder per backend: `torch/` (torch ops, any device; also
the reference twins of the other kernels' stages), `cpu/` (the native C kernels and their
ctypes binding), `triton/` (CUDA, or the CPU under TRITON_INTERPRET=1), `wgsl/` (WebGPU
shaders). The backends (`deltarule.backends`) turn a validated call into their launches."""
