"""transformers' hybrid models on deltarule: `enable()` and every linear-attention layer runs here.

transformers (>= 5) binds the recurrences of its hybrid models once, when a
modeling module is imported, through
``@use_kernel_func_from_hub_with_fallback("<fla function>", "fla")``: fla's
function when ``import fla`` succeeds (GPU-only: on a CPU every such model then
fails at its first forward), its own slow PyTorch fallback otherwise. The
forwards look those module-level names up at every call, so replacing the
module attributes reaches every model, built before `enable()` or after::

    import deltarule.integrations.transformers as dt
    dt.enable()          # every family of the installed transformers, found from its sources
    model.generate(...)  # prefill, cached decode, left padding, packed sequences, training
    dt.disable()         # transformers' own bindings back

What is replaced, per modeling module that binds one of fla's four functions
(`FLA_KERNELS`): those names (`torch_chunk_gated_delta_rule`,
`chunk_kimi_delta_attention`, ...) by deltarule's fla drop-ins
(`deltarule.contracts.fla`), and the module's ``causal_conv1d_fn`` by deltarule's
`causal_conv1d`, which keeps packed sequences (``cu_seq_lens_q``) apart and keeps the
layers' token-major memory (unpacked CUDA tensors still go to the original).
CUDA tensors go to fla when it is installed (``cuda="fla"``, the default) and to
deltarule with ``cuda="deltarule"``; every other device always runs deltarule.

`torch_fallback()` binds transformers' own PyTorch fallbacks instead (for
comparisons, also where fla is installed and would fail on a CPU). See
docs/transformers.md for the families found and the versions tested.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import ContractError, Unsupported

__all__ = ["Binding", "bindings", "enable", "disable", "enabled", "torch_fallback", "causal_conv1d",
           "FLA_KERNELS", "TESTED_VERSIONS"]

# fla's functions that transformers' modeling files bind; deltarule.contracts.fla has each of them.
FLA_KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda")
# The prefill convolution of the same layers: replaced so that packed sequences stay apart.
CONV_KERNEL = "causal_conv1d_fn"
MIN_MAJOR = 5
TESTED_VERSIONS = ("5.16.1", "5.20.2", "5.24.0")

_DECORATED = re.compile(
    r'@use_kernel_func_from_hub_with_fallback\(\s*"(\w+)"\s*,\s*"(\w+)"[^)]*\)\s*\n\s*def\s+(\w+)')


@dataclass(frozen=True)
class Binding:
    """One module-level name a modeling module binds to a hub kernel.

    ``family`` is the model package (``"qwen3_next"``), ``module`` the modeling
    module's import path, ``attribute`` the name its forward calls
    (``"torch_chunk_gated_delta_rule"``), ``kernel`` the hub function bound to it
    (``"chunk_gated_delta_rule"``, or ``"causal_conv1d_fn"``).
    """

    family: str
    module: str
    attribute: str
    kernel: str


def bindings() -> tuple[Binding, ...]:
    """Every binding of `FLA_KERNELS` (and those modules' prefill convolution) in the installed transformers.

    Found by reading the ``modeling_*.py`` sources of ``transformers.models`` (no
    modeling module is imported). Raises `deltarule.Unsupported` when
    transformers is missing or binds none of them (before 5.15).
    """
    try:
        import transformers
        import transformers.models
    except ImportError as error:
        raise Unsupported(f"deltarule.integrations.transformers needs transformers >= {MIN_MAJOR}: {error}") from None
    version = transformers.__version__
    if int(version.split(".")[0]) < MIN_MAJOR:
        raise Unsupported(
            f"transformers {version} is not supported: its hybrid models bind fla's kernels through "
            f"use_kernel_func_from_hub_with_fallback from 5.15 on (tested: {', '.join(TESTED_VERSIONS)})")
    found = _scan_sources(tuple(transformers.models.__path__))
    if not any(b.kernel in FLA_KERNELS for b in found):
        raise Unsupported(
            f"transformers {version} binds none of {', '.join(FLA_KERNELS)} with "
            f"use_kernel_func_from_hub_with_fallback (that binding appeared in 5.15; before it the layers "
            f"kept their kernels as instance attributes; tested: {', '.join(TESTED_VERSIONS)})")
    return tuple(found)


@functools.lru_cache(maxsize=4)
def _scan_sources(roots: tuple[str, ...]) -> tuple[Binding, ...]:
    """The bindings of every modeling source under `roots`, read once per process."""
    found = []
    for root in roots:
        for path in sorted(Path(root).glob("*/modeling_*.py")):
            found += _scan(path.parent.name, f"transformers.models.{path.parent.name}.{path.stem}", path.read_text())
    return tuple(found)


def _scan(family: str, module: str, source: str) -> list[Binding]:
    """The decorated names of one modeling source: fla's kernels, and the convolution beside them."""
    decorated = [(kernel, package, attribute) for kernel, package, attribute in _DECORATED.findall(source)]
    if not any(kernel in FLA_KERNELS and package == "fla" for kernel, package, _ in decorated):
        return []
    return [Binding(family, module, attribute, kernel) for kernel, package, attribute in decorated
            if (kernel in FLA_KERNELS and package == "fla") or kernel == CONV_KERNEL]


# (module, attribute) -> transformers' own object, kept while anything else is bound there.
_originals: dict[tuple[str, str], object] = {}


def enable(*, cuda: str = "fla") -> tuple[Binding, ...]:
    """Run the linear-attention layers of every hybrid family in transformers on deltarule.

    Args:
        cuda: ``"fla"`` (default): CUDA tensors go to fla's kernels when fla is
            installed (to deltarule when it is not); ``"deltarule"``: CUDA tensors
            run on deltarule too. Tensors on any other device always run on deltarule.

    Returns the bindings replaced. Imports the modeling modules found by
    `bindings()`; models built before the call are covered (their forwards look
    the names up per call). Calling it again rebinds with the new ``cuda``.
    `disable()` restores transformers' bindings.

    Raises `deltarule.Unsupported` on a transformers without such bindings, and
    `deltarule.ContractError` for a ``cuda`` other than the two above.
    """
    if cuda not in ("fla", "deltarule"):
        raise ContractError("cuda", "'fla' or 'deltarule'", repr(cuda))
    to_fla = cuda == "fla" and importlib.util.find_spec("fla") is not None
    found = bindings()
    for binding, module, original in _import(found):
        if binding.kernel == CONV_KERNEL:
            replacement = _conv(original)
        else:
            replacement = _recurrence(binding.kernel, original if to_fla else None)
        _bind(binding, module, original, replacement)
    return found


def disable() -> None:
    """Put transformers' own bindings back (a no-op when nothing is bound)."""
    for (module, attribute), original in _originals.items():
        setattr(sys.modules[module], attribute, original)
    _originals.clear()


def enabled() -> bool:
    """Whether `enable()` (or `torch_fallback()`) has replaced transformers' bindings."""
    return bool(_originals)


@contextlib.contextmanager
def torch_fallback() -> Iterator[tuple[Binding, ...]]:
    """Within the block the layers run transformers' own PyTorch fallbacks.

    Whatever was bound before (transformers' choice, or deltarule after
    `enable()`) is bound again on exit. For comparisons: with fla installed,
    transformers binds fla's GPU-only kernels, which fail on a CPU.
    """
    found = bindings()
    before = {}
    for binding, module, original in _import(found):
        before[binding] = getattr(module, binding.attribute)
        _bind(binding, module, original, original.__wrapped__)
    try:
        yield found
    finally:
        for binding, current in before.items():
            setattr(sys.modules[binding.module], binding.attribute, current)
        if all(current is _originals.get((b.module, b.attribute)) for b, current in before.items()):
            _originals.clear()


def _import(found: tuple[Binding, ...]) -> list[tuple[Binding, object, Callable]]:
    """Each binding with its imported module and transformers' own object for it."""
    resolved = []
    for binding in found:
        module = importlib.import_module(binding.module)
        original = _originals.get((binding.module, binding.attribute), getattr(module, binding.attribute, None))
        if not callable(getattr(original, "__wrapped__", None)):
            raise Unsupported(
                f"{binding.module}.{binding.attribute} is not a use_kernel_func_from_hub_with_fallback binding "
                f"with a torch fallback in this transformers (tested: {', '.join(TESTED_VERSIONS)})")
        resolved.append((binding, module, original))
    return resolved


def _bind(binding: Binding, module, original, replacement) -> None:
    _originals.setdefault((binding.module, binding.attribute), original)
    setattr(module, binding.attribute, replacement)


def _recurrence(kernel: str, fla_binding: Callable | None) -> Callable:
    """deltarule's drop-in for fla's `kernel`, called the way transformers' wrapper calls fla.

    Like transformers' wrapper, keywords the function does not name (``use_cache``,
    ``cu_seq_lens_k``, ``max_length_q``, ...) are dropped. The KDA layers leave
    the packed sequences' ``cu_seq_lens_q`` unrenamed: it becomes ``cu_seqlens``.
    With `fla_binding` (transformers' binding to fla), CUDA tensors go there.
    """
    from ..contracts import fla as drop_ins

    function = getattr(drop_ins, kernel)
    named = frozenset(name for name, parameter in inspect.signature(function).parameters.items()
                      if parameter.kind is not parameter.VAR_KEYWORD)

    def recurrence(q, k, v, **kwargs):
        if fla_binding is not None and q.is_cuda:
            return fla_binding(q, k, v, **kwargs)
        if kwargs.get("cu_seqlens") is None and kwargs.get("cu_seq_lens_q") is not None:
            kwargs["cu_seqlens"] = kwargs["cu_seq_lens_q"]
        return function(q, k, v, **{name: value for name, value in kwargs.items() if name in named})

    recurrence.__name__ = recurrence.__qualname__ = f"deltarule_{kernel}"
    recurrence.__doc__ = f"deltarule.contracts.fla.{kernel}, bound by deltarule.integrations.transformers."
    recurrence.__wrapped__ = function
    return recurrence


def _conv(original: Callable) -> Callable:
    """transformers' prefill convolution: deltarule's `causal_conv1d` except for unpacked CUDA tensors.

    Packed sequences (``cu_seq_lens_q``) restart the convolution at every sequence, on
    every device. CUDA tensors without packing go to the original (the causal_conv1d
    package's kernel where it is installed).
    """
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None and hidden_states.is_cuda:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return causal_conv1d(hidden_states, weight, bias, activation=activation, cu_seqlens=cu_seqlens)

    causal_conv1d_fn.__wrapped__ = original
    return causal_conv1d_fn


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
