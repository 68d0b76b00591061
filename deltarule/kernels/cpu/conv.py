"""ctypes binding of the native short convolution (csrc/conv.c); deltarule/conv/ prepares
its operands and owns the semantics. Compute only: no checks beyond the struct's layout.
`ConvLaunch` packs the problem struct once per call signature; `conv` packs and runs one
call."""

import ctypes
import threading

import torch

from .layout import CONV, MAX_PARTS
from .recurrent import _LIB

_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CHANNEL_BLOCK = 512          # conv.c's CB: a task is one sequence's block of channels
# a thread per this many (token, channel) elements: a B = 8 decode step of 6144 channels takes
# 2 threads (~0.1 ms on one), a B = 1 step one. Threads only from torch's OpenMP pool
# (cpu_recurrent.use_threads("openmp")); with "own" the conv runs on the calling thread.
ELEMENTS_PER_THREAD = 1 << 14


# a run repacks the addresses of the operands, the struct's first fields
_ADDRESSES = CONV.leading("x", "out", "wt", "bias", "state")


def available() -> bool:
    return _LIB is not None


class ConvLaunch:
    """One call signature's packed `conv_problem`: the constructor takes example operands
    (`conv`'s; their shapes, dtypes and strides are fixed from then on) and keeps the tables;
    `run` packs only the addresses of x, out, wt, bias and state (the struct's first five
    fields) and calls the kernel. A decode step's layers each run one (the vLLM plugin keeps
    them per layer): a few microseconds of Python instead of a full pack."""

    def __init__(self, x, out, wt, bias, state, seq, *, rolling: bool, silu: bool, gather: bool,
                 splits: tuple[int, ...]):
        T, cut, base = x.shape[0], [0], []
        for width in splits:
            base.append(T * cut[-1])
            cut.append(cut[-1] + width)
        pad = MAX_PARTS - len(splits)
        self._seq = seq
        self._buf = CONV.pack(
            x=x.data_ptr(), out=out.data_ptr(), wt=wt.data_ptr(), bias=0 if bias is None else bias.data_ptr(),
            state=state.data_ptr(), seq=seq.data_ptr(), x_row=x.stride(0), s_slot=state.stride(0),
            s_col=state.stride(1), s_chan=state.stride(2), N=seq.shape[0], C=x.shape[1], W=wt.shape[0],
            x_type=_TYPES[x.dtype], s_type=_TYPES[state.dtype], rolling=int(rolling), silu=int(silu),
            gather=int(gather), parts=len(splits), cut=(*cut, *[0] * pad), part_base=(*base, *[0] * pad))
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        blocks = (x.shape[1] + CHANNEL_BLOCK - 1) // CHANNEL_BLOCK
        self.threads = max(1, min(seq.shape[0] * blocks, T * x.shape[1] // ELEMENTS_PER_THREAD))
        self._busy = threading.Lock()

    def run(self, x: int, out: int, wt: int, bias: int, state: int) -> None:
        """The kernel on operands at these addresses (0: no bias), shaped as the constructor's.
        Thread-safe (a call that finds the buffer in use packs a private copy)."""
        threads = min(torch.get_num_threads(), self.threads)
        if self._busy.acquire(False):
            try:
                _ADDRESSES.pack_into(self._buf, 0, x, out, wt, bias, state)
                status = _LIB.deltarule_conv(self._address, threads)
            finally:
                self._busy.release()
        else:
            buf = bytearray(self._buf)
            _ADDRESSES.pack_into(buf, 0, x, out, wt, bias, state)
            status = _LIB.deltarule_conv(ctypes.addressof(ctypes.c_char.from_buffer(buf)), threads)
        if status:
            raise MemoryError("deltarule cpu conv: out of memory") if status == 1 else \
                RuntimeError(f"deltarule cpu conv: status {status}")


def conv(x: torch.Tensor, out: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
         seq: torch.Tensor, *, rolling: bool, silu: bool, gather: bool, splits: tuple[int, ...]) -> None:
    """x [T, C] (channel stride 1), out [T * C] contiguous in x's dtype holding the parts
    [T, splits[i]] one after the other (splits sum to C), wt [W, C] float32
    contiguous, bias [C] float32 or None, state [slots, S, C] (any strides), seq [N, 5] int64
    contiguous (start, length, read row, read column, write row); gather: a sequence writes a
    row another reads (every prior is read first)."""
    ConvLaunch(x, out, wt, bias, state, seq, rolling=rolling, silu=silu, gather=gather, splits=splits).run(
        x.data_ptr(), out.data_ptr(), wt.data_ptr(), 0 if bias is None else bias.data_ptr(), state.data_ptr())
