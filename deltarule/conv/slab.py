"""`causal_conv1d_slab`: one call of the short convolution over packed sequences, reading and
updating a conv-state slab by a `ConvPlan` (the native cpu kernel, csrc/conv.c, or torch
gathers on any device), its argument checks, and `KeptConv`, its cpu form checked once for a
caller that repeats one call signature (the vLLM plugin's decode steps)."""

from __future__ import annotations

import numbers
from collections import OrderedDict

import torch
import torch.nn.functional as F

from .. import aliasing
from ..errors import ContractError
from ..kernels.cpu import conv as cpu_conv
from .checks import ACTIVATIONS, INPUT_TYPES, STATE_TYPES, check_tensor
from .plan import ConvPlan

BACKENDS = ("auto", "cpu", "torch")


def causal_conv1d_slab(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                       plan: ConvPlan, *, activation: str | None = "silu", backend: str = "auto",
                       splits: tuple[int, ...] | None = None, out: torch.Tensor | None = None):
    """Depthwise causal convolution of packed sequences, reading and updating `conv_state`.

    Args:
        x: [T, C] token-major inputs (any strides), float32 / bfloat16 / float16 (float64:
            `reference_conv1d_slab`).
        weight: [C, W] taps, float32 / bfloat16 / float16; weight[:, W - 1] multiplies the
            current token.
        bias: [C] or None, float32 / bfloat16 / float16.
        conv_state: [slots, S', C] slab (any strides: vLLM's [slots, C, S'] memory is passed as
            its transpose), x's dtype or float32, sharing no memory with itself, x, weight or
            bias; the plan's rows are updated IN PLACE.
        plan: from `plan_conv` (S <= S'; every row it names < slots).
        activation: None or "silu".
        backend: "cpu" (the native kernel, csrc/conv.c: CPU tensors, x with channel stride 1,
            W <= 16), "torch" (gathers, any device), or "auto" (default): cpu where it applies.
        splits: None, or up to 4 channel counts summing to C: return the output split along
            its channels into that many contiguous tensors (a layer's q, k, v: the cpu form
            writes them where they lie).
        out: None, or a contiguous 1-D tensor of x's dtype and device with at least T * C
            elements: the outputs are written into its first T * C (the returned tensors are
            views of it; a caller's workspace kept between calls, so that a layer's prefill
            does not allocate and free tens of MB per call).

    Returns [T, C] (or the `splits` tuple of [T, C_i]) in x's dtype, computed in float32:
    out[t] = act(bias + sum_j weight[:, j] * input(t - (W - 1) + j)).

    Raises ContractError for any invalid argument, before any work (nothing written); also
    with autograd on and an argument that requires grad (not differentiable).

    >>> import torch
    >>> from deltarule.conv import causal_conv1d_slab, plan_conv
    >>> plan = plan_conv([2], width=2, read_rows=[0], write_rows=[0])
    >>> state = torch.full((1, 1, 1), 10.)
    >>> causal_conv1d_slab(torch.tensor([[1.], [2.]]), torch.ones(1, 2), None, state, plan, activation=None)
    tensor([[11.],
            [ 3.]])
    >>> state.flatten().tolist()
    [2.0]
    """
    T, C, W, S, parts, native = _checked(x, weight, bias, conv_state, plan, activation, backend, splits, out)
    if native and backend != "torch":
        flat = torch.empty(T * C, dtype=x.dtype) if out is None else out[:T * C]
        wt, b = _prepared(weight, bias)
        cpu_conv.conv(x, flat, wt, b, conv_state, plan.table, rolling=plan.rolling, silu=activation == "silu",
                      gather=plan.crossed, splits=parts)
        views = _views(flat, T, parts)
        return views[0] if splits is None else views
    # the plan's tables live on the host: gathers on another device take their indices there
    device = x.device
    read = plan.table[:, 2].to(device)                            # -1: no prior, zeros
    taps = plan.taps.to(device)
    if conv_state.shape[0]:
        prior = conv_state.index_select(0, read.clamp(min=0))[:, :S].float()
        prior[read < 0] = 0
    else:                                                         # a slab of no rows: every row is padding
        prior = torch.zeros(read.shape[0], S, C, device=device)
    src = torch.cat((prior.reshape(prior.shape[0] * S, C), x.float()))
    w = weight.float()
    acc = src.index_select(0, taps[W - 1]) * w[:, W - 1]
    for j in range(W - 1):
        acc.addcmul_(src.index_select(0, taps[j]), w[:, j])
    if bias is not None:
        acc += bias.float()
    if activation == "silu":
        acc = F.silu(acc, inplace=True)
    if plan.write_rows.numel():
        conv_state.index_put_((plan.write_rows.to(device), plan.write_cols.to(device)),
                              src.index_select(0, plan.write_src.to(device)).to(conv_state.dtype))
    results = acc.split(list(parts), dim=1)
    if out is None:
        results = tuple(r.to(x.dtype).contiguous() for r in results)
    else:
        views = _views(out, T, parts)
        for view, r in zip(views, results):
            view.copy_(r)
        results = views
    return results[0] if splits is None else results


def _views(flat: torch.Tensor, T: int, parts: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The output parts [T, parts[i]] laid one after the other from the start of `flat`."""
    views, at = [], 0
    for width in parts:
        views.append(flat[at:at + T * width].view(T, width))
        at += T * width
    return tuple(views)


def _checked(x, weight, bias, conv_state, plan, activation, backend, splits, out):
    """`causal_conv1d_slab`'s argument checks, every one before any work: (T, C, W, S, the
    output parts' channel counts, whether the cpu form takes the call) or ContractError."""
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ContractError("activation", f"one of {ACTIVATIONS}", repr(activation))
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ContractError("backend", f"one of {BACKENDS}", repr(backend))
    if not isinstance(plan, ConvPlan):
        raise ContractError("plan", "a deltarule.conv.ConvPlan (plan_conv)", type(plan).__name__)
    check_tensor("x", x, 2, INPUT_TYPES, "[T, C]")
    device = x.device
    T, C = x.shape
    W, S = plan.width, plan.columns
    if T != plan.tokens:
        raise ContractError("x", f"[T, C] with T = {plan.tokens} (the plan's tokens)", tuple(x.shape))
    check_tensor("weight", weight, 2, INPUT_TYPES, f"[C, W] = [{C}, {W}]", device, (C, W))
    if bias is not None:
        check_tensor("bias", bias, 1, INPUT_TYPES, f"[C] = [{C}]", device, (C,))
    check_tensor("conv_state", conv_state, 3, STATE_TYPES, f"[slots, S >= {S}, C = {C}]", device)
    if conv_state.shape[1] < S or conv_state.shape[2] != C:
        raise ContractError("conv_state", f"[slots, S >= {S}, C = {C}]", tuple(conv_state.shape))
    if conv_state.dtype not in (x.dtype, torch.float32):
        raise ContractError("conv_state", f"x's dtype {x.dtype} or torch.float32", conv_state.dtype)
    plan.check_slab(conv_state.shape[0])
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state)):
            if t is not None and t.requires_grad:
                raise ContractError(name, "a tensor that does not require grad, or autograd off (the convolution "
                                    "is not differentiable: conv_state is updated in place)", "requires_grad=True")
    native = (device.type == "cpu" and x.stride(1) == 1 and W <= 16 and cpu_conv.available())
    if backend == "cpu" and not native:
        why = (f"x on {device}" if device.type != "cpu" else f"x's channel stride {x.stride(1)}"
               if x.stride(1) != 1 else f"W = {W}" if W > 16 else "the native kernel not built")
        raise ContractError("backend", "'cpu' for CPU tensors with x's channel stride 1 and W <= 16 "
                            "(and the native kernel built)", f"'cpu' with {why}")
    if splits is None:
        parts = (C,)                                 # C = 0 too: a [T, 0] output
    elif not isinstance(splits, (tuple, list)) or not 1 <= len(splits) <= cpu_conv.MAX_PARTS \
            or any(isinstance(p, bool) or not isinstance(p, numbers.Integral) or p < 1 for p in splits) \
            or sum(splits) != C:
        raise ContractError("splits", f"1 to {cpu_conv.MAX_PARTS} positive channel counts summing to {C}", splits)
    else:
        parts = tuple(int(p) for p in splits)
    if out is not None and (not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous()
                            or out.numel() < T * C or out.dtype != x.dtype or out.device != device):
        raise ContractError("out", f"a contiguous 1-D {x.dtype} tensor on {device} of >= {T * C} elements",
                            (tuple(out.shape), out.dtype, str(out.device), out.is_contiguous())
                            if isinstance(out, torch.Tensor) else type(out).__name__)
    # conv_state is written after every read of x, weight and bias (a view of the slab among them
    # would be read after a write), and so is out
    aliasing.check_written("conv_state", conv_state, (("x", x), ("weight", weight), ("bias", bias)))
    if out is not None:
        aliasing.check_written("out", out[:T * C], (("x", x), ("weight", weight), ("bias", bias),
                                                    ("conv_state", conv_state)))
    return T, C, W, S, parts, native


class KeptConv:
    """`causal_conv1d_slab`'s cpu form (with `splits` and `out`) for one plan and call
    signature, checked once as the function checks every call: calling it with tensors of the
    example's shapes, dtypes and strides runs the kernel with no checks but the taps' version
    (a weight or bias changed in place is converted again). For a caller that keeps it per
    layer (the vLLM plugin's decode steps) and guarantees what the function checks per call:
    x, conv_state and out of the example's signature, out sharing no memory with the others.
    Calling returns the parts as `causal_conv1d_slab` does, views of `out`."""

    def __init__(self, x, weight, bias, conv_state, plan: ConvPlan, *, activation: str | None,
                 splits: tuple[int, ...], out: torch.Tensor):
        T, C, W, S, parts, native = _checked(x, weight, bias, conv_state, plan, activation, "cpu", splits, out)
        self.weight, self.bias, self.T, self.parts = weight, bias, T, parts
        wt, b = _prepared(weight, bias)
        self.launch = cpu_conv.ConvLaunch(x, out[:T * C], wt, b, conv_state, plan.table, rolling=plan.rolling,
                                          silu=activation == "silu", gather=plan.crossed, splits=parts)

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.run(x, conv_state, out)
        return self.views(out)

    def views(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The output parts [T, splits[i]] as views of `out` (what a call returns; no kernel)."""
        return _views(out, self.T, self.parts)

    def run(self, x: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor) -> None:
        """`__call__` without making the views (for a caller that keeps its own)."""
        wt, b = _prepared(self.weight, self.bias)
        self.launch.run(x.data_ptr(), out.data_ptr(), wt.data_ptr(), 0 if b is None else b.data_ptr(),
                        conv_state.data_ptr())


_PREPARED: OrderedDict = OrderedDict()


def _prepared(weight: torch.Tensor, bias: torch.Tensor | None):
    """weight as [W, C] float32 and bias as float32, kept per (tensor, version): a layer's
    taps are converted once, not per call. Entries hold their tensors, so an id is never
    reused while cached."""
    key = (id(weight), id(bias))
    versions = (weight._version, None if bias is None else bias._version)
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not weight or hit[1] is not bias or hit[2] != versions:
        hit = (weight, bias, versions, weight.t().float().contiguous(),
               None if bias is None else bias.float().contiguous())
        _PREPARED[key] = hit
        while len(_PREPARED) > 256:
            _PREPARED.popitem(last=False)
    return hit[3], hit[4]
