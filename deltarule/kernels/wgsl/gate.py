"""The fused gate as one WGSL dispatch (`gate.wgsl.jinja`)."""

from __future__ import annotations

import math
import struct

import torch

from . import _device

TEMPLATE = "gate.wgsl.jinja"
WORKGROUP = 256


def fused_gate(a: torch.Tensor, dt_bias: torch.Tensor, decay_scale: torch.Tensor,
               b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """decay = decay_scale * softplus(a + dt_bias); beta = sigmoid(b), in float32 on the GPU.

    The same contract as `deltarule.gate` (which validates; this does not).

    Args:
        a: [..., H] float32 / float16 / bfloat16 raw decay projection.
        dt_bias: [H] float32 bias added to `a`.
        decay_scale: [H] float32 multiplier (`-exp(A_log)` for Gated DeltaNet).
        b: optional [..., H] raw update rate, `a`'s dtype.

    Returns:
        (decay, beta) in `a`'s dtype and device (beta None without `b`); narrowed
        from float32 only on the host's final cast.
    """
    count, H = a.numel(), a.shape[-1]
    spec = (("dtype", _device.SHADER_DTYPES[a.dtype]), ("has_b", b is not None))
    gpu = _device.gpu()
    groups = math.ceil(count / WORKGROUP)
    nx = min(groups, gpu.max_workgroups)
    grid = (max(nx, 1), math.ceil(groups / nx) if groups else 1, 1)
    decay = _device.zeros(count * 4)
    buffers = {
        0: _device.uniform(struct.pack("<3I", count, H, nx * WORKGROUP)),
        1: _device.upload(torch.cat([dt_bias.to("cpu", torch.float32), decay_scale.to("cpu", torch.float32)])),
        2: decay, 3: _device.upload(a),
    }
    beta = None
    if b is not None:
        beta = _device.zeros(count * 4)
        buffers.update({4: _device.upload(b), 5: beta})
    if count:
        _device.dispatch(TEMPLATE, spec, buffers, grid)

    def fetch(buf):
        if not count:
            return torch.empty(a.shape, dtype=a.dtype, device=a.device)
        raw = bytearray(_device.download(buf, count * 4))
        return torch.frombuffer(raw, dtype=torch.float32).view(a.shape).to(a.device, a.dtype)

    return fetch(decay), None if beta is None else fetch(beta)
