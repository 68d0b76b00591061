"""deltarule's layers for HF `kernels`: how transformers >= 5.25 is extended.

From transformers 5.25 on (with `kernels` >= 0.19 installed, which 5.25 requires),
``@use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`` no longer
leaves a wrapped function at the modeling module's name but an instance of
kernels' ``Func`` (an ``nn.Module`` whose class carries ``kernel_layer_name``): a
*kernelizable function*. `kernels.kernelize` replaces such a module's ``forward``
with the ``forward`` of a layer class loaded from a repository in the kernel
mapping. This module holds deltarule's layer classes, one per kernel name
transformers binds (`LAYERS`), and `REPOSITORY`, a local kernel repository in
kernels' own layout (``torch-universal/metadata.json`` + ``__init__.py``, shipped as
package data) whose ``layers`` are these classes. A local repository's variant folder may sit
at its top (kernels looks for ``<repo>/<variant>`` before ``<repo>/build/<variant>``; only Hub
repositories need ``build/``), so no tracked folder is named like a build output.

Two ways to use it:

- ``deltarule.integrations.transformers.enable()`` kernelizes the module-level
  functions themselves (every model, built before or after), see there;
- per model, kernels' own way: ``with kernels.use_kernel_mapping(kernel_mapping()):
  kernels.kernelize(model, mode=Mode.INFERENCE, device="cpu")``, or
  ``kernels.register_kernel_mapping(kernel_mapping())`` before ``from_pretrained``
  (which kernelizes by default from 5.25 on).

kernels validates a layer against the function it replaces: no constructor, no
members but ``can_torch_compile`` / ``has_backward``, and a ``forward`` with the
same parameters. The forwards below spell transformers' 5.25 signatures out, so a
release that changes one fails the check (`matches`) and that family stays on
transformers' own path instead of being called with arguments it does not expect.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

from .drop_ins import call_drop_in, causal_conv1d

__all__ = ["REPOSITORY", "LAYERS", "kernel_mapping", "matches", "send_cuda_to_transformers",
           "ChunkGatedDeltaRule", "FusedRecurrentGatedDeltaRule", "ChunkKda", "FusedRecurrentKda", "CausalConv1dFn"]

# kernels' local repository layout: <repo>/build/<variant>/{metadata.json, __init__.py}
REPOSITORY = Path(__file__).with_name("hf_kernel_repository")

# enable(cuda="fla") sends CUDA tensors of the layers it bound to transformers' own binding
# (fla's kernels, or the causal_conv1d package's); set through `send_cuda_to_transformers` by
# deltarule.integrations.transformers.
cuda_to_transformers = False


def send_cuda_to_transformers(on: bool) -> None:
    """Whether the layers hand CUDA tensors (unpacked) to transformers' own binding: ``enable(cuda=...)``."""
    global cuda_to_transformers
    cuda_to_transformers = on


def _to_transformers(tensor: torch.Tensor, packed: bool = False) -> bool:
    return cuda_to_transformers and tensor.is_cuda and not packed


class ChunkGatedDeltaRule(torch.nn.Module):
    """fla's ``chunk_gated_delta_rule`` as transformers' GDN layers call it, on deltarule."""

    can_torch_compile = True
    has_backward = True

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        arguments = dict(g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _recurrence(self, "chunk_gated_delta_rule", query, key, value, {**arguments, **kwargs})


class FusedRecurrentGatedDeltaRule(torch.nn.Module):
    """fla's ``fused_recurrent_gated_delta_rule`` (one-token decode steps), on deltarule."""

    can_torch_compile = True
    has_backward = True

    def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        arguments = dict(g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _recurrence(self, "fused_recurrent_gated_delta_rule", query, key, value, {**arguments, **kwargs})


class ChunkKda(torch.nn.Module):
    """fla's ``chunk_kda`` as transformers' KDA layers call it, on deltarule."""

    can_torch_compile = True
    has_backward = True

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        arguments = dict(g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _recurrence(self, "chunk_kda", query, key, value, {**arguments, **kwargs})


class FusedRecurrentKda(torch.nn.Module):
    """fla's ``fused_recurrent_kda`` (one-token decode steps), on deltarule."""

    can_torch_compile = True
    has_backward = True

    def forward(self, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel=False,
                **kwargs):
        arguments = dict(g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _recurrence(self, "fused_recurrent_kda", query, key, value, {**arguments, **kwargs})


class CausalConv1dFn(torch.nn.Module):
    """The layers' prefill convolution: deltarule's `causal_conv1d` (packed sequences kept apart)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if _to_transformers(hidden_states, packed=cu_seqlens is not None):
            return type(self).forward(self, hidden_states, weight, bias, activation, **kwargs)
        return causal_conv1d(hidden_states, weight, bias, activation=activation, cu_seqlens=cu_seqlens)


# transformers' kernel name -> deltarule's layer class for it
LAYERS = {"chunk_gated_delta_rule": ChunkGatedDeltaRule,
          "fused_recurrent_gated_delta_rule": FusedRecurrentGatedDeltaRule,
          "chunk_kda": ChunkKda, "fused_recurrent_kda": FusedRecurrentKda,
          "causal_conv1d_fn": CausalConv1dFn}


def _recurrence(func: torch.nn.Module, kernel: str, query, key, value, kwargs: dict):
    """A layer's call: transformers' own binding for CUDA tensors after enable(cuda="fla"), else the drop-in."""
    if _to_transformers(query):
        return type(func).forward(func, query, key, value, **kwargs)
    return call_drop_in(kernel, query, key, value, kwargs)


def kernel_mapping(*, cuda: bool = False) -> dict:
    """The kernel mapping of deltarule's layers, for `kernels.use_kernel_mapping` / `register_kernel_mapping`.

    Args:
        cuda: also map CUDA devices (default: CPU only; CUDA models keep fla's kernels).

    Returns ``{kernel name: {device: kernels.LocalLayerRepository(REPOSITORY, layer_name=...)}}``
    for the five names of `LAYERS`. Needs `kernels` (>= 0.19).

    >>> import kernels
    >>> sorted(kernel_mapping())[:2]
    ['causal_conv1d_fn', 'chunk_gated_delta_rule']
    """
    import kernels

    devices = ("cpu", "cuda") if cuda else ("cpu",)
    return {name: {device: kernels.LocalLayerRepository(REPOSITORY, layer_name=layer.__name__)
                   for device in devices} for name, layer in LAYERS.items()}


def matches(func: torch.nn.Module, kernel: str) -> str | None:
    """None when `func` (a kernelizable function) can take deltarule's layer for `kernel`, else why not."""
    ours = inspect.signature(LAYERS[kernel].forward).parameters
    theirs = inspect.signature(type(func).forward).parameters
    spelled = lambda ps: [(p.name, p.kind) for p in ps.values()]  # noqa: E731
    if spelled(ours) != spelled(theirs):
        return (f"its signature {tuple(theirs)} is not the one deltarule's {LAYERS[kernel].__name__} "
                f"takes {tuple(ours)}")
    return None


class _QuietMissingDigest(logging.Filter):
    """kernels warns at every load of a repository whose metadata has no file digest. REPOSITORY is
    part of deltarule's installed files, so it has none: a digest would be broken by the bytecode
    Python writes beside its ``__init__.py`` (and installers compile ahead)."""

    def filter(self, record):
        message = record.getMessage()
        return not (message.startswith("Kernel 'deltarule' ") and "digest" in message)


logging.getLogger("kernels._internals.validate").addFilter(_QuietMissingDigest())
