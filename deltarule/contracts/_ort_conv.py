"""`com.microsoft.CausalConvWithState` (onnxruntime 1.32): the stateful causal depthwise
convolution of the hybrid models' linear layers, every input, attribute and output the
schema defines, on torch ops and `deltarule.conv`. The public name lives in
`deltarule.contracts.ort`.

Everything is brought to one canonical form, [R, C, L] rows of channels over the causal
axis (R = batch x the non-causal positions), convolved in float32, and put back into the
caller's layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..conv import conv1d_with_state
from ..errors import ContractError
from ._convert import Kind, dtype_name
from .onnx_linear_attention import FLOAT_DTYPES, check_int_attr

ACTIVATIONS = ("none", "silu", "swish")
# the schema's ranges: state_window "[0, 8]", state_update_capacity "0..8"
MAX_STATE_WINDOW = 8
MAX_CAPACITY = 8
# the attributes the schema calls extended (CUDA only), with their defaults
EXTENDED = (("state_update_capacity", 0), ("state_length", 0), ("state_channels_last", -1),
            ("input_channel_offset", 0), ("input_channels", 0))


def causal_conv_with_state(
    input,
    weight,
    bias=None,
    past_state=None,
    *,
    ndim: int = 1,
    activation: str = "none",
    dilation: int = 1,
    channels_last: int = 0,
    state_window: int = 0,
    state_update_capacity: int = 0,
    state_length: int = 0,
    state_channels_last: int = -1,
    input_channel_offset: int = 0,
    input_channels: int = 0,
):
    """`com.microsoft.CausalConvWithState`: returns (output, present_state), and with
    state_update_capacity > 0 (output, present_state, state_update).

    Letters: B batch, C channels, L positions on the causal axis (the last spatial one),
    k the causal kernel size, d the dilation, SL the state length ((k - 1) * d unless
    `state_length` says more), W the state window, T the type of every tensor.

    Per channel c and position t:
    out[t] = act(bias[c] + sum_j weight[c, 0, ..., j] * v[t - (k - 1 - j) * d]), with v the
    virtual input (past_state, then input) along the causal axis; computed in float32,
    stored in T.

    Args:
        input: float32 / float16 / bfloat16 (T). channels_last = 0: [B, C, L] (ndim 1),
            [B, C, H, L] (ndim 2), [B, C, D, H, L] (ndim 3). channels_last = 1 (ndim 1):
            [B, L, d_1, ..., d_n], n >= 1, C = d_1 * ... * d_n. With input_channels > 0:
            [B, L, input_width] (channels last), of which channels
            [input_channel_offset, input_channel_offset + input_channels) are convolved.
        weight: [C, 1, k_1, ..., k_ndim], T. The causal kernel is k = k_ndim; with ndim > 1
            every other k_i must be 1 (the schema does not say how the other axes are
            padded: ContractError naming `ndim` otherwise).
        bias: optional [C], T.
        past_state: optional, T: the SL positions before the input along the causal axis
            (oldest first), zeros when absent; not modified. Channels-first state:
            [B, C, L-less spatial..., SL] ([B, C, SL] for ndim 1); channels-last state:
            [B, SL, d_1, ..., d_n] ([B, SL, C] with state_channels_last = 1 or a channel
            selection). With W > 0 a leading [W] axis, of which only slot W - 1 is read.
        ndim: 1 (default), 2 or 3 spatial axes.
        activation: "none" (default), "silu" or "swish" (the same function).
        dilation: d >= 1, default 1.
        channels_last: 0 (default) or 1 (sequence-major input, output and state; ndim 1).
        state_window: W in [0, 8], default 0.
        state_update_capacity: in [0, 8], default 0 (extended).
        state_length: 0 (default: (k - 1) * d) or an explicit SL >= (k - 1) * d (extended;
            the convolution reads the state's last (k - 1) * d positions).
        state_channels_last: -1 (default: as channels_last), 0 ([B, C, SL]) or 1
            ([B, SL, C]) (extended).
        input_channel_offset, input_channels: the channel slice of a channels-last
            [B, L, input_width] input (extended); input_channels 0 (default) takes all.

    The extended attributes (all but ndim, activation, dilation, channels_last,
    state_window) need a rank-3 input and W = 0 (the schema's rule; ContractError naming
    the attribute); state_update_capacity > 0 and a channel selection also need
    channels_last = 1 (the schema defines both on the channels-last input only).

    Returns:
        output: input's shape ([B, L, input_channels] with a channel selection), T.
        present_state: past_state's shape and layout, T: the last SL positions of the
            virtual input. With W > 0 [W, ...]: slot j holds them for the prefix ending at
            position L - W + j (0-based), so slot W - 1 is the W = 0 state, and slots
            j < W - L, which hold no position of this call, are zeros (with L = 0 that is
            every slot, as the schema's rule reads).
        state_update (only with capacity > 0): [B, capacity, C], T: input rows
            0 .. min(L, capacity) - 1 (after the channel selection), zero rows after.

    Raises:
        ContractError: any input or attribute the operator rejects or leaves undefined,
            before any work.
    """
    kind = Kind("input", input)
    x = kind.tensor("input", input, optional=False)
    if x.dtype not in FLOAT_DTYPES:
        raise ContractError("input", "dtype float32, float16 or bfloat16 (type T)", dtype_name(x.dtype))
    a = _attributes(ndim, activation, dilation, channels_last, state_window, state_update_capacity,
                    state_length, state_channels_last, input_channel_offset, input_channels, x)
    w = kind.tensor("weight", weight, optional=False)
    b, s = kind.tensor("bias", bias), kind.tensor("past_state", past_state)
    for name, t in (("weight", w), ("bias", b), ("past_state", s)):
        if t is not None and t.dtype != x.dtype:
            raise ContractError(name, f"input's dtype {dtype_name(x.dtype)} (type T)", dtype_name(t.dtype))
        if t is not None and t.device != x.device:
            raise ContractError(name, f"device {x.device} (input's)", t.device)
    lay = _layout(x, w, a)
    if b is not None and tuple(b.shape) != (lay.C,):
        raise ContractError("bias", f"shape [C] = [{lay.C}]", f"shape {list(b.shape)}")
    prior = _past_state(s, lay, a, x.device)
    rows = lay.rows(lay.selected(x))                               # [R, C, L]
    virtual = torch.cat((prior.float(), rows.float()), dim=-1)     # [R, C, SL + L]
    y = _convolve(rows, virtual, w.reshape(lay.C, lay.k), b, a, lay)
    out = (kind.out(lay.unrows(y, lay.out_shape)), kind.out(_present(virtual, lay, a).to(x.dtype)))
    if a.capacity == 0:
        return out
    return out + (kind.out(_state_update(lay.selected(x), a.capacity)),)


@dataclass(frozen=True)
class Attributes:
    ndim: int
    silu: bool
    dilation: int
    channels_last: bool
    window: int
    capacity: int
    state_length: int
    state_channels_last: bool
    offset: int
    channels: int


def _attributes(ndim, activation, dilation, channels_last, state_window, state_update_capacity, state_length,
                state_channels_last, input_channel_offset, input_channels, x: torch.Tensor) -> Attributes:
    """The attributes, checked alone and against each other and the input's rank."""
    nd = check_int_attr("ndim", ndim, minimum=1, maximum=3)
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ContractError("activation", " | ".join(repr(a) for a in ACTIVATIONS), repr(activation))
    dil = check_int_attr("dilation", dilation, minimum=1)
    cl = check_int_attr("channels_last", channels_last, minimum=0, maximum=1)
    if cl and nd != 1:
        raise ContractError("channels_last", f"0 with ndim = {nd} (channels_last = 1 requires ndim = 1)", cl)
    window = check_int_attr("state_window", state_window, minimum=0, maximum=MAX_STATE_WINDOW)
    capacity = check_int_attr("state_update_capacity", state_update_capacity, minimum=0, maximum=MAX_CAPACITY)
    length = check_int_attr("state_length", state_length, minimum=0)
    scl = check_int_attr("state_channels_last", state_channels_last, minimum=-1, maximum=1)
    offset = check_int_attr("input_channel_offset", input_channel_offset, minimum=0)
    channels = check_int_attr("input_channels", input_channels, minimum=0)
    values = dict(state_update_capacity=capacity, state_length=length, state_channels_last=scl,
                  input_channel_offset=offset, input_channels=channels)
    for name, default in EXTENDED:
        if values[name] == default:
            continue
        if x.dim() != 3:
            raise ContractError(name, f"{default} with a rank-{x.dim()} input (nondefault extended attributes "
                                "require a rank-3 input)", values[name])
        if window:
            raise ContractError(name, f"{default} with state_window = {window} (nondefault extended attributes "
                                "require state_window = 0)", values[name])
    if offset and not channels:
        raise ContractError("input_channel_offset", "0 when input_channels is 0 (the offset starts the "
                            "input_channels-wide slice; with 'all channels' the schema defines no slice)", offset)
    if channels and not cl:
        raise ContractError("input_channels", "0 with channels_last = 0 (the schema defines the channel slice "
                            "on the channels-last (batch_size, sequence_length, input_width) input only)", channels)
    if capacity and not cl:
        raise ContractError("state_update_capacity", "0 with channels_last = 0 (state_update requires the "
                            "rank-3 channels-last input)", capacity)
    return Attributes(nd, activation != "none", dil, bool(cl), window, capacity, length,
                      bool(cl) if scl == -1 else bool(scl), offset, channels)


@dataclass(frozen=True)
class Layout:
    """Where the channels, the causal axis and the other spatial axes lie, for the input and the
    state, and the shapes the outputs take."""

    B: int
    C: int
    L: int
    k: int
    receptive: int             # (k - 1) * d: the history the convolution reads
    state_len: int             # SL
    channels_last: bool
    mid: tuple                 # channels-first: the non-causal spatial extents (ndim > 1)
    trailing: tuple            # channels-last: the channel axes d_1 .. d_n
    out_shape: tuple
    state_shape: tuple         # one slot
    state_channels_last: bool
    offset_end: tuple | None   # the channel slice [start, end) of a channel selection

    def selected(self, x: torch.Tensor) -> torch.Tensor:
        """The convolved part of the input (a channel slice, or all of it)."""
        return x if self.offset_end is None else x[..., self.offset_end[0]:self.offset_end[1]]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """An input-layout tensor [B, ...] as [R, C, L]."""
        if self.channels_last:
            return x.reshape(self.B, x.shape[1], self.C).transpose(1, 2)
        n = len(self.mid)
        order = (0, *range(2, 2 + n), 1, 2 + n)                    # [B, mid..., C, L]
        return x.permute(order).reshape(self.B * math.prod(self.mid), self.C, x.shape[-1])

    def unrows(self, y: torch.Tensor, shape: tuple) -> torch.Tensor:
        """[R, C, L'] back to an input-layout tensor of `shape`."""
        if self.channels_last:
            return y.transpose(1, 2).reshape(shape)
        n = len(self.mid)
        y = y.reshape(self.B, *self.mid, self.C, y.shape[-1])
        return y.permute(0, n + 1, *range(1, n + 1), n + 2).reshape(shape)

    def state_rows(self, s: torch.Tensor) -> torch.Tensor:
        """One state slot as [R, C, SL]."""
        if self.state_channels_last:
            return s.reshape(self.B, self.state_len, self.C).transpose(1, 2)
        return self.rows(s) if not self.channels_last else s

    def state_unrows(self, s: torch.Tensor) -> torch.Tensor:
        """[R, C, SL] back to one state slot."""
        if self.state_channels_last:
            return s.transpose(1, 2).reshape(self.state_shape)
        return s if self.channels_last else self.unrows(s, self.state_shape)


def _layout(x: torch.Tensor, w: torch.Tensor, a: Attributes) -> Layout:
    """The input's and weight's shapes checked, and the layout they give."""
    offset_end = None
    if a.channels_last:
        if x.dim() < 3:
            raise ContractError("input", "rank >= 3 (batch_size, sequence_length, d_1, ..., d_n) with "
                                "channels_last = 1", f"shape {list(x.shape)}")
        B, L, trailing = x.shape[0], x.shape[1], tuple(x.shape[2:])
        C, mid = math.prod(trailing), ()
        if a.channels:
            if a.offset + a.channels > x.shape[2]:
                raise ContractError("input_channels", f"input_channel_offset + input_channels <= input_width = "
                                    f"{x.shape[2]}", f"{a.offset} + {a.channels}")
            C, trailing, offset_end = a.channels, (a.channels,), (a.offset, a.offset + a.channels)
        out_shape = (B, L) + trailing
    else:
        if x.dim() != a.ndim + 2:
            raise ContractError("input", f"rank ndim + 2 = {a.ndim + 2} (batch_size, channels, spatial...)",
                                f"shape {list(x.shape)}")
        B, C, L, mid, trailing = x.shape[0], x.shape[1], x.shape[-1], tuple(x.shape[2:-1]), ()
        out_shape = tuple(x.shape)
    if w.dim() != a.ndim + 2 or w.shape[0] != C or w.shape[1] != 1 or any(e < 1 for e in w.shape[2:]):
        raise ContractError("weight", f"(channels, 1, k_1, ..., k_ndim) with channels = {C}, ndim = {a.ndim}, "
                            "k_i >= 1 (depthwise)", f"shape {list(w.shape)}")
    if any(e != 1 for e in w.shape[2:-1]):
        raise ContractError("ndim", f"kernel extent 1 on the non-causal axes with ndim = {a.ndim} (the schema "
                            "keeps the output's shape but does not define how those axes are padded)",
                            f"weight shape {list(w.shape)}")
    k = w.shape[-1]
    receptive = (k - 1) * a.dilation
    if a.state_length and a.state_length < receptive:
        raise ContractError("state_length", f"0 or >= (kernel_size - 1) * dilation = {receptive} (an explicit "
                            "length must cover the receptive field)", a.state_length)
    SL = a.state_length or receptive
    if a.state_channels_last:
        state_shape = (B, SL) + (trailing if a.channels_last and not a.channels else (C,))
    else:
        state_shape = (B, C) + mid + (SL,)
    return Layout(B, C, L, k, receptive, SL, a.channels_last, mid, trailing, out_shape, state_shape,
                  a.state_channels_last, offset_end)


def _past_state(s: torch.Tensor | None, lay: Layout, a: Attributes, device) -> torch.Tensor:
    """past_state (slot W - 1 with a window) as [R, C, SL], zeros when absent."""
    R = lay.B * math.prod(lay.mid)
    if s is None:
        return torch.zeros((R, lay.C, lay.state_len), dtype=torch.float32, device=device)
    want = ((a.window,) if a.window else ()) + lay.state_shape
    if tuple(s.shape) != want:
        where = f"state_window = {a.window}, " if a.window else ""
        raise ContractError("past_state", f"shape {list(want)} ({where}state_length = {lay.state_len}, "
                            f"{'channels-last' if lay.state_channels_last else 'channels-first'} state)",
                            f"shape {list(s.shape)}")
    return lay.state_rows(s[a.window - 1] if a.window else s)


def _convolve(rows, virtual, w, b, a: Attributes, lay: Layout) -> torch.Tensor:
    """[R, C, L] outputs in T: deltarule's causal conv (`conv.conv1d_with_state`) for the
    undilated kernel, a dilated depthwise conv1d in float32 otherwise."""
    history = virtual[..., virtual.shape[-1] - lay.L - lay.receptive:]   # the last (k - 1) * d before, then L
    act = "silu" if a.silu else None
    if a.dilation == 1:
        y, _ = conv1d_with_state(rows, w, b, history[..., : lay.receptive].to(rows.dtype), act)
        return y
    if lay.C == 0 or lay.L == 0 or rows.shape[0] == 0:
        return rows.new_empty(rows.shape)
    y = F.conv1d(history, w.float().unsqueeze(1), None if b is None else b.float(), dilation=a.dilation,
                 groups=lay.C)
    return (F.silu(y) if a.silu else y).to(rows.dtype)


def _present(virtual: torch.Tensor, lay: Layout, a: Attributes) -> torch.Tensor:
    """present_state: the last SL positions of the virtual input (per window slot with W > 0:
    slot j for the prefix ending at position L - W + j; zeros where that is before the call)."""
    SL, L = lay.state_len, lay.L
    if not a.window:
        return lay.state_unrows(virtual[..., L:])
    slots = []
    for j in range(a.window):
        end = L - a.window + j + 1                  # one past the prefix's last position
        part = virtual[..., end: end + SL] if end > 0 else torch.zeros_like(virtual[..., :SL])
        slots.append(lay.state_unrows(part))
    return torch.stack(slots)


def _state_update(x: torch.Tensor, capacity: int) -> torch.Tensor:
    """[B, capacity, C]: the first min(L, capacity) input rows (channels last), zero rows after."""
    B, L, C = x.shape
    out = x.new_zeros((B, capacity, C))
    n = min(L, capacity)
    out[:, :n] = x[:, :n]
    return out
