"""Patching a vLLM module when vLLM imports it, not before: importing vLLM's model modules in
the plugin (which runs in every vLLM process, before its worker starts) is a change of its
own — Kimi Linear's pulls in numba, whose objects broke the worker's scan for Triton kernels to
override — and most of them are never imported for the model being served."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _PostImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` once `name` has been imported."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        patch = self.patch

        def run(module):
            exec_module(module)
            patch(module)
        spec.loader.exec_module = run
        return spec


def after_import(name: str, patch) -> None:
    """`patch(module)` for module `name`: now if it is imported, else right after vLLM imports it
    (once per name: a second request for a name already waiting is dropped)."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _PostImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(name, patch))
