"""Lets torchvision's Python part import in the vLLM tests' Qwen3.5 engines (on PYTHONPATH there
only, beside `.venv-vllm/torchvision`, which `.ci/vllm install` fills; docs/vllm.md).

vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor, which imports
torchvision. PyPI has no CPU build of torchvision: its wheel's ops library (_C.so) links CUDA
and cannot load beside torch 2.13.0+cpu, and torchvision's import then fails where it declares
fake kernels for two of that library's ops (nms, qnms). Their schemas are declared here, with
no kernel: the rest of torchvision does not need _C.so, and a text model never calls them (a
call would fail: no kernel). A real deployment installs torchvision's CPU build from PyTorch's
index instead."""

import torch

_LIBRARY = torch.library.Library("torchvision", "DEF")        # kept: the definitions live with it
for _op in ("nms", "qnms"):
    _LIBRARY.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
