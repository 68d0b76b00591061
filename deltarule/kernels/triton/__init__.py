"""Triton kernels: `recurrent` (decode, short sequences, speculative rows), `chunked` (the
chunked prefill in named stages), `backward` (the token-serial reverse kernel), `common`
(helpers shared by the kernels). Imported on first use: importing triton is slow."""
