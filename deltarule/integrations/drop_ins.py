"""The calls both of transformers' bindings make: deltarule's drop-ins, called as transformers calls fla.

Shared by the two ways deltarule is bound under transformers' hybrid models, so that
neither imports the other:

- `deltarule.integrations.transformers` (module attributes replaced, transformers 5.16 - 5.24);
- `deltarule.integrations.hf_kernels` (layers of HF kernels, transformers >= 5.25).

`call_drop_in` calls deltarule's drop-in for one of fla's functions
(`deltarule.contracts.fla`) with the keywords transformers' wrapper passes;
`causal_conv1d` is the layers' prefill convolution (packed sequences kept apart,
token-major memory kept). Neither looks at the device: sending CUDA tensors to
transformers' own binding is each binding's choice.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ..errors import ContractError

__all__ = ["call_drop_in", "causal_conv1d"]


def call_drop_in(kernel: str, q, k, v, kwargs: dict):
    """deltarule's drop-in for fla's `kernel`, called the way transformers' wrapper calls fla.

    Like transformers' wrapper, keywords the function does not name (``use_cache``,
    ``cu_seq_lens_k``, ``max_length_q``, ...) are dropped. The KDA layers leave the
    packed sequences' ``cu_seq_lens_q`` unrenamed: it becomes ``cu_seqlens``.
    """
    function, named = _drop_in(kernel)
    if kwargs.get("cu_seqlens") is None and kwargs.get("cu_seq_lens_q") is not None:
        kwargs = {**kwargs, "cu_seqlens": kwargs["cu_seq_lens_q"]}
    return function(q, k, v, **{name: value for name, value in kwargs.items() if name in named})


# kernel -> (deltarule's drop-in, the keywords it names); a dict, not lru_cache, which Dynamo warns about
_DROP_INS: dict[str, tuple[Callable, frozenset]] = {}


def _drop_in(kernel: str) -> tuple[Callable, frozenset]:
    if kernel not in _DROP_INS:
        from ..contracts import fla as drop_ins

        function = getattr(drop_ins, kernel)
        _DROP_INS[kernel] = function, frozenset(name for name, p in inspect.signature(function).parameters.items()
                                                if p.kind is not p.VAR_KEYWORD)
    return _DROP_INS[kernel]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  activation: str | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution, optionally over packed sequences (restarting at each one).

    Args:
        x: ``[B, C, T]``; any strides. The layers pass the transpose of their projection
            (T-major memory), and the output keeps that layout, so the q, k, v split from it
            are token rows deltarule copies at memory speed (transformers' F.conv1d returns
            C-major memory: a transposing copy per input, and a 3.6x slower convolution here).
        weight: ``[C, W]``, the depthwise taps (the last one multiplies the current token).
        bias: ``[C]`` or None.
        activation: a name of transformers' ``ACT2FN`` (``"silu"``) or None.
        cu_seqlens: None, or ``[N + 1]`` integer offsets of packed sequences (B = 1),
            ``cu_seqlens[-1] == T``.

    Returns ``[B, C, T]`` in x's dtype, computed in weight's dtype like transformers'
    fallback: out[t] = sum_s weight[:, W-1-s] * x[t-s] over the s < W with t-s in t's sequence.

    >>> x = torch.arange(6.).view(1, 1, 6); w = torch.ones(1, 2)
    >>> causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 2, 6]))
    tensor([[[0., 1., 2., 5., 7., 9.]]])
    >>> causal_conv1d(x, w)
    tensor([[[0., 1., 3., 5., 7., 9.]]])
    """
    T = x.shape[-1]
    if cu_seqlens is not None:
        if x.dim() != 3 or x.shape[0] != 1:
            raise ContractError("hidden_states", "[1, C, T] with packed sequences (cu_seq_lens_q)", tuple(x.shape))
        if cu_seqlens.dim() != 1 or int(cu_seqlens[-1]) != T or int(cu_seqlens[0]) != 0:
            raise ContractError("cu_seq_lens_q", f"offsets from 0 to the packed length {T}",
                                cu_seqlens.tolist() if cu_seqlens.numel() < 16 else tuple(cu_seqlens.shape))
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=x.device, dtype=torch.long)
        starts = cu_seqlens[:-1].to(device=x.device, dtype=torch.long)
        position = torch.arange(T, device=x.device) - torch.repeat_interleave(starts, lengths, output_size=T)
    x_w = x.to(weight.dtype)
    width = weight.shape[-1]
    # elementwise ops keep x's memory layout; in-place accumulation into slices of out
    out = x_w * weight[:, width - 1, None]
    for shift in range(1, min(width, T)):
        earlier = x_w[..., :-shift]
        if cu_seqlens is not None:
            keep = (position[shift:] >= shift).to(weight.dtype)
            earlier = earlier * keep
        out[..., shift:].addcmul_(earlier, weight[:, width - 1 - shift, None])
    if bias is not None:
        out += bias[:, None]
    if activation is not None:
        from transformers.activations import ACT2FN
        out = ACT2FN[activation](out)
    return out.to(x.dtype)
