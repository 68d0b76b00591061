"""ctypes binding of the native short convolution (csrc/conv.c); deltarule/conv.py prepares
its operands and owns the semantics. Compute only: no checks beyond the struct's layout.
The problem struct is packed into a buffer kept per thread (ctypes releases the GIL during
the call, so threads may call at once)."""

import ctypes
import struct
import threading

import torch

from .cpu_recurrent import _LIB

_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_PARTS = 4


# csrc/conv.c's `conv_problem`: x out wt bias state seq (pointers); x_row s_slot s_col s_chan N C W
# (int64); x_type s_type rolling silu gather parts (int32); cut[MAX_PARTS + 1], part_base[MAX_PARTS]
_PROBLEM = struct.Struct(f"@6P7q6i{MAX_PARTS + 1}q{MAX_PARTS}q")
_LOCAL = threading.local()       # one packed problem per thread: ctypes drops the GIL during the call


def _buffer() -> tuple[bytearray, int]:
    buf = getattr(_LOCAL, "buf", None)
    if buf is None:
        data = bytearray(_PROBLEM.size)
        buf = _LOCAL.buf = (data, ctypes.addressof(ctypes.c_char.from_buffer(data)))
    return buf


def available() -> bool:
    return _LIB is not None and _LIB.deltarule_conv_problem_size() == _PROBLEM.size


def conv(x: torch.Tensor, out: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
         seq: torch.Tensor, *, rolling: bool, silu: bool, gather: bool, splits: tuple[int, ...]) -> None:
    """x [T, C] (channel stride 1), out [T * C] contiguous in x's dtype holding the parts
    [T, splits[i]] one after the other (splits sum to C), wt [W, C] float32
    contiguous, bias [C] float32 or None, state [slots, S, C] (any strides), seq [N, 5] int64
    contiguous (start, length, read row, read column, write row); gather: a sequence writes a
    row another reads (every prior is read first)."""
    T, cut, base = x.shape[0], [0], []
    for width in splits:
        base.append(T * cut[-1])
        cut.append(cut[-1] + width)
    pad = MAX_PARTS - len(splits)
    buf, address = _buffer()
    _PROBLEM.pack_into(buf, 0, x.data_ptr(), out.data_ptr(), wt.data_ptr(), 0 if bias is None else bias.data_ptr(),
                       state.data_ptr(), seq.data_ptr(), x.stride(0), *state.stride(), seq.shape[0], x.shape[1],
                       wt.shape[0], _TYPES[x.dtype], _TYPES[state.dtype], int(rolling), int(silu), int(gather),
                       len(splits), *cut, *[0] * pad, *base, *[0] * pad)
    status = _LIB.deltarule_conv(address)
    if status:
        raise MemoryError("deltarule cpu conv: out of memory") if status == 1 else \
            RuntimeError(f"deltarule cpu conv: status {status}")
