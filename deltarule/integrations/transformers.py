"""transformers' hybrid models on deltarule: `enable()` and every linear-attention layer runs here.

transformers (>= 5.15) binds the recurrences of its hybrid models once, when a
modeling module is imported, through
``@use_kernel_func_from_hub_with_fallback("<fla function>", "fla")``, and the
layers' forwards look those module-level names up at every call, so rebinding the
names reaches every model, built before `enable()` or after::

    import deltarule.integrations.transformers as dt
    result = dt.enable()  # every family of the installed transformers, found from its sources
    model.generate(...)   # prefill, cached decode, left padding, packed sequences, training
    dt.disable()          # transformers' own bindings back, exactly

How a name is rebound follows the form transformers gives it:

- **5.25 on** (HF ``kernels`` >= 0.19): the name is a *kernelizable function*, an
  ``nn.Module`` of kernels' (``kernel_layer_name`` = fla's function name). `enable()`
  kernelizes it, with kernels' own ``kernelize`` and a mapping to deltarule's layers
  in a local kernel repository (`deltarule.integrations.hf_kernels`); `disable()`
  puts its previous ``forward`` back. Per model, without `enable()`:
  ``kernels.kernelize(model, ...)`` inside ``kernels.use_kernel_mapping(hf_kernels.kernel_mapping())``.
- **5.16 - 5.24**: the name is transformers' wrapper function (the PyTorch fallback
  as ``__wrapped__``); `enable()` replaces the module attribute.

What is bound, per modeling module that binds one of fla's four functions
(`FLA_KERNELS`): those names (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ...) to deltarule's fla drop-ins
(`deltarule.contracts.fla`), and the module's ``causal_conv1d_fn`` to deltarule's
`causal_conv1d`, which keeps packed sequences (``cu_seq_lens_q``) apart and keeps the
layers' token-major memory. Each family is checked whole before anything is bound: a
binding of an unknown form, a changed signature or a module that does not import
leaves that family on transformers' own path with one `RuntimeWarning` (or raises
with ``strict=True``), and `enable()` returns what it bound and what it left.
CUDA tensors go to transformers' own binding (fla) by default (``cuda="fla"``) and
to deltarule with ``cuda="deltarule"``; every other device always runs deltarule.

`torch_fallback()` binds transformers' own PyTorch fallbacks instead (for
comparisons, also where fla is installed). See docs/transformers.md for the
families found and the versions tested.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import ContractError, Unsupported
from ..tools.versions import TESTED
from .drop_ins import call_drop_in, causal_conv1d

__all__ = ["Binding", "Enabled", "bindings", "enable", "disable", "enabled", "torch_fallback", "causal_conv1d",
           "FLA_KERNELS", "TESTED_VERSIONS"]

# fla's functions that transformers' modeling files bind; deltarule.contracts.fla has each of them.
FLA_KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda")
# The prefill convolution of the same layers: replaced so that packed sequences stay apart.
CONV_KERNEL = "causal_conv1d_fn"
MIN_MAJOR = 5
TESTED_VERSIONS = TESTED["transformers"]

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


# (module, attribute) -> what puts transformers' own binding back, kept while deltarule is bound there.
_restores: dict[tuple[str, str], Callable[[], None]] = {}


@dataclass(frozen=True)
class Enabled:
    """What `enable()` did: the bindings it replaced, and the families it left on transformers' path.

    ``left`` maps a family to the reason (the attribute and the installed versions).
    """

    bound: tuple[Binding, ...]
    left: dict[str, str]

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted({b.family for b in self.bound}))


def enable(*, cuda: str = "fla", strict: bool = False) -> Enabled:
    """Run the linear-attention layers of every hybrid family in transformers on deltarule.

    Args:
        cuda: ``"fla"`` (default): CUDA tensors keep transformers' own binding (fla's
            kernels where installed); ``"deltarule"``: CUDA tensors run on deltarule too.
            Tensors on any other device always run on deltarule.
        strict: raise `deltarule.Unsupported` (binding nothing) when a family's binding
            is not one deltarule recognises, instead of leaving that family on
            transformers' path with a `RuntimeWarning` naming the family, the
            attribute and the installed version.

    Returns an `Enabled`: ``bound``, the bindings replaced; ``left``, family -> why
    it stays on transformers' own path. Imports the modeling modules found by
    `bindings()`; models built before the call are covered. How it binds depends on
    the installed transformers: from 5.25 on (HF `kernels` bindings) each module-level
    kernelizable function is kernelized with deltarule's layers
    (`deltarule.integrations.hf_kernels`, a local kernel repository); on 5.16-5.24
    the module attribute is replaced. Calling it again rebinds with the new ``cuda``;
    `disable()` restores exactly what was there.

    Raises `deltarule.Unsupported` on a transformers without such bindings, and
    `deltarule.ContractError` for a ``cuda`` other than the two above.
    """
    if cuda not in ("fla", "deltarule"):
        raise ContractError("cuda", "'fla' or 'deltarule'", repr(cuda))
    if not isinstance(strict, bool):
        raise ContractError("strict", "a bool", repr(strict))
    found = bindings()
    _note_untested()
    resolved, left = _resolve_families(found)
    if left and strict:
        raise Unsupported("; ".join(f"{family}: {why}" for family, why in left.items()))
    for family, why in left.items():
        warnings.warn(f"deltarule: transformers family {family!r} stays on transformers' own path: {why}",
                      RuntimeWarning, stacklevel=2)
    disable()
    to_fla = cuda == "fla"
    for binding, module, current in resolved:
        if _is_kernelizable(current):
            _restores[(binding.module, binding.attribute)] = _kernelize(binding, current)
        else:
            replacement = (_conv(current) if binding.kernel == CONV_KERNEL
                           else _recurrence(binding.kernel, current, to_fla=to_fla and _fla_installed()))
            _restores[(binding.module, binding.attribute)] = _replace(module, binding.attribute, replacement)
    from . import hf_kernels
    hf_kernels.send_cuda_to_transformers(to_fla)
    return Enabled(bound=tuple(b for b, _, _ in resolved), left=left)


def disable() -> None:
    """Put transformers' own bindings back (a no-op when nothing is bound)."""
    for restore in _restores.values():
        restore()
    _restores.clear()


def enabled() -> bool:
    """Whether `enable()` has replaced transformers' bindings."""
    return bool(_restores)


@contextlib.contextmanager
def torch_fallback() -> Iterator[tuple[Binding, ...]]:
    """Within the block the layers run transformers' own PyTorch fallbacks.

    Whatever was bound before (transformers' choice, or deltarule after
    `enable()`) is bound again on exit. For comparisons: transformers binds fla's
    GPU kernels where fla is installed (before 5.25 also for CPU tensors, which fail).
    Families whose binding is not recognised keep what they have.
    """
    found = bindings()
    resolved, _ = _resolve_families(found)
    undo = []
    for binding, module, current in resolved:
        fallback = _torch_function(current)
        if _is_kernelizable(current):
            undo.append(_set_forward(current, fallback))
        else:
            undo.append(_replace(module, binding.attribute, fallback))
    try:
        yield tuple(b for b, _, _ in resolved)
    finally:
        for restore in reversed(undo):
            restore()


_log = logging.getLogger(__name__)
_noted: set[str] = set()


def _note_untested() -> None:
    """One log line per process for a transformers release outside the tested ones (it may work:
    each binding is still checked, and a family whose binding is not recognised stays on transformers)."""
    import transformers

    version = transformers.__version__
    if version not in TESTED_VERSIONS and version not in _noted:
        _noted.add(version)
        _log.warning("deltarule: transformers %s is not a release deltarule tests (tested: %s); every binding "
                     "is checked before it is replaced", version, ", ".join(TESTED_VERSIONS))


def _resolve_families(found: tuple[Binding, ...]) -> tuple[list[tuple[Binding, object, object]], dict[str, str]]:
    """Each binding of the families deltarule can bind, with its module and transformers' object;
    the other families with the reason. A family is bound whole or not at all."""
    resolved, left = [], {}
    for family in sorted({b.family for b in found}):
        group = [b for b in found if b.family == family]
        try:
            resolved += [_resolve(b) for b in group]
        except Unsupported as why:
            left[family] = str(why)
    return resolved, left


def _resolve(binding: Binding) -> tuple[Binding, object, object]:
    """The binding, its imported module and transformers' own object; Unsupported when its form is unknown."""
    import transformers

    versions = f"transformers {transformers.__version__}{_kernels_version()}"
    try:
        module = importlib.import_module(binding.module)
    except Exception as error:  # a modeling module that does not import is that family's problem only
        raise Unsupported(f"{binding.module} does not import ({type(error).__name__}: {error}; {versions})") from None
    original = _unwrapped_original(getattr(module, binding.attribute, None))
    where = f"{binding.module}.{binding.attribute}"
    if _is_kernelizable(original):
        from . import hf_kernels
        if getattr(type(original), "kernel_layer_name", None) != binding.kernel:
            raise Unsupported(f"{where} is kernels' function {type(original).kernel_layer_name!r}, not "
                              f"{binding.kernel!r} ({versions})")
        why = hf_kernels.matches(original, binding.kernel)
        if why is None and _torch_function(original, strict=False) is None:
            why = "its PyTorch fallback cannot be found in the kernels binding"
        if why is not None:
            raise Unsupported(f"{where}: {why} ({versions}; tested: {', '.join(TESTED_VERSIONS)})")
        return binding, module, original
    if not callable(getattr(original, "__wrapped__", None)):
        raise Unsupported(
            f"{where} is not a use_kernel_func_from_hub_with_fallback binding with a torch fallback "
            f"({type(original).__name__}; {versions}; tested: {', '.join(TESTED_VERSIONS)})")
    return binding, module, original


def _is_kernelizable(obj) -> bool:
    """A kernels ``Func``: the form of transformers' bindings from 5.25 on (an nn.Module with a layer name)."""
    return isinstance(obj, torch.nn.Module) and isinstance(getattr(type(obj), "kernel_layer_name", None), str)


def _kernels_version() -> str:
    try:
        return f", kernels {importlib.metadata.version('kernels')}"
    except importlib.metadata.PackageNotFoundError:
        return ""


def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def _replace(module, attribute: str, replacement) -> Callable[[], None]:
    """Set a module attribute; returns what puts the previous object back."""
    previous = getattr(module, attribute)
    setattr(module, attribute, replacement)
    return lambda: setattr(module, attribute, previous)


def _snapshot(func: torch.nn.Module) -> Callable[[], None]:
    """What puts a kernelizable function's kernelization (its instance forward and repository) back."""
    keys = ("forward", "_kernel_repo")
    saved = {key: func.__dict__[key] for key in keys if key in func.__dict__}

    def restore():
        for key in keys:
            func.__dict__.pop(key, None)
        func.__dict__.update(saved)
    return restore


def _set_forward(func: torch.nn.Module, forward) -> Callable[[], None]:
    """Give a kernelizable function an instance forward (as kernelize does); returns the undo."""
    restore = _snapshot(func)
    func.__dict__.pop("_kernel_repo", None)
    func.__dict__["forward"] = forward
    return restore


def _kernelize(binding: Binding, func: torch.nn.Module) -> Callable[[], None]:
    """kernels' `kernelize` of one module-level function with deltarule's layer; returns the undo.

    The function is a module, so kernelizing it reaches every model (their layers call it
    by its module-level name). The mapping is used for this call only: registering it
    globally would also kernelize later `from_pretrained` models, which `disable()` could
    not undo.
    """
    import kernels

    from . import hf_kernels

    undo = _snapshot(func)
    mapping = {binding.kernel: hf_kernels.kernel_mapping()[binding.kernel]}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(func, mode=kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE, device="cpu",
                          use_fallback=False)
    bound = getattr(func.__dict__.get("forward"), "__func__", None)
    if bound is not hf_kernels.LAYERS[binding.kernel].forward:
        undo()
        raise Unsupported(f"kernels did not bind deltarule's layer to {binding.module}.{binding.attribute} "
                          f"(DISABLE_KERNEL_MAPPING set?{_kernels_version()})")
    return undo


def _torch_function(current, *, strict: bool = True):
    """transformers' PyTorch fallback behind a binding (the function the decorator wrapped)."""
    if _is_kernelizable(current):
        # kernels' Func.forward closes over transformers' wrapper, which functools.wraps the fallback
        try:
            wrapper = inspect.getclosurevars(type(current).forward).nonlocals.get("func")
        except (TypeError, ValueError):
            wrapper = None
        fallback = getattr(wrapper, "__wrapped__", None)
    else:
        fallback = getattr(_unwrapped_original(current), "__wrapped__", None)
    if fallback is None and strict:
        raise Unsupported(f"no PyTorch fallback found behind {current!r}")
    return fallback


def _unwrapped_original(current):
    """transformers' own object behind deltarule's replacement (before 5.25), else `current` itself."""
    return getattr(current, "_deltarule_original", current)


def _recurrence(kernel: str, original: Callable | None, *, to_fla: bool = False) -> Callable:
    """The module attribute bound before 5.25: deltarule's drop-in for fla's `kernel`.

    `original` is transformers' binding; with `to_fla` (it binds fla) CUDA tensors go there.
    """
    fla_binding = original if to_fla else None
    fla_binding_original = original
    from ..contracts import fla as drop_ins

    def recurrence(q, k, v, **kwargs):
        if fla_binding is not None and q.is_cuda:
            return fla_binding(q, k, v, **kwargs)
        return call_drop_in(kernel, q, k, v, kwargs)

    recurrence.__name__ = recurrence.__qualname__ = f"deltarule_{kernel}"
    recurrence.__doc__ = f"deltarule.contracts.fla.{kernel}, bound by deltarule.integrations.transformers."
    recurrence.__wrapped__ = getattr(drop_ins, kernel)
    recurrence._deltarule_original = fla_binding_original
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
    causal_conv1d_fn._deltarule_original = original
    return causal_conv1d_fn
