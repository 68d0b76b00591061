"""The model families the plugin runs on deltarule, in one table (docs/vllm.md, "Families")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import kimi, olmo, qwen


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]   # vLLM's model classes (config.json "architectures") it serves
    hook: Callable[[], None]         # installs its layers' hooks and its fixes, each when vLLM imports the module
    check_config: Callable | None = None   # (vllm_config, check): its fixes around the CPU platform's config
    #                                         check `check`, run only for its architectures


FAMILIES = (
    Family("Qwen3-Next / Qwen3.5", qwen.ARCHITECTURES, qwen.hook),
    Family("OLMo-Hybrid", olmo.ARCHITECTURES, olmo.hook),
    Family("Kimi Linear", kimi.ARCHITECTURES, kimi.hook, kimi.check_config),
)
