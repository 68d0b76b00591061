"""The native CPU kernels (`csrc/`: recurrence, reverse kernel, short convolution), built by
setup.py into `_native`, and their ctypes bindings: `recurrent` (and the backward), `conv`,
`layout` (the C structs' field tables, checked against the library's when it loads)."""
