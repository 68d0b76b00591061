"""The recurrence in torch ops, on any device: token by token (`recurrent`), chunked (WY / UT,
`chunked`), and their reverse walks (`recurrent_backward`, `chunked_backward`). The torch
backend runs them; they are also the reference twins of the native and Triton kernels' stages."""
