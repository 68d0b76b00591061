"""The `wgsl` backend: WGSL compute shaders on any WebGPU adapter, through wgpu-py.

Inputs are torch tensors (any device) copied to the WebGPU device in their
own dtype; the fused recurrence (`deltarule/kernels/wgsl/`) applies the
raw-gate arm, beta_sigmoid and the L2 norm in the shader. The state runs in
place in one device buffer: a copy of `initial_state` (or zeros), the
gathered rows of a torch slab, or a `WgslStateSlab` that never leaves the
device. Outputs come back to `q`'s device as torch tensors.
"""

from __future__ import annotations

import torch

from ..problem import Problem
from ._features import EVERYTHING

NAME = "wgsl"
DESCRIPTION = "WGSL compute shaders through WebGPU (wgpu): fused recurrence, device-resident state slab"
SUPPORTS = dict(
    EVERYTHING,
    dtypes="float32, float16, bfloat16 inputs (16-bit read as packed words: no shader-f16 needed); "
           "float32 state",
    devices="any WebGPU adapter (Vulkan, Metal, D3D12; lavapipe on CPU); torch tensors on any device "
            "are copied to it, a WgslStateSlab stays there",
    note="prefill runs the fused recurrence (no chunked form yet); not in auto's order",
)


def available() -> bool:
    from ..kernels.wgsl import unavailable_reason

    return unavailable_reason() is None


def supports(p: Problem) -> str | None:
    from ..kernels.wgsl import _device, recurrent

    gpu = _device.gpu()
    need = recurrent.bindings_needed(p)
    if need > gpu.max_storage_buffers:
        return f"needs {need} storage buffers per shader stage, the adapter allows {gpu.max_storage_buffers}"
    live = sum(s.slot >= 0 for s in p.spans)
    if live > gpu.max_workgroups:
        return f"{live} sequences: more than the adapter's {gpu.max_workgroups} workgroups per dimension"
    state_rows = p.initial_state.shape[0] if p.in_place else p.N
    largest = 4 * max(p.B * p.T * p.Ho * p.V, p.B * p.T * p.Hq * p.K, state_rows * p.Hv * p.K * p.V)
    if largest > gpu.max_binding_bytes:
        return f"a {largest}-byte buffer: more than the adapter's {gpu.max_binding_bytes}-byte binding limit"
    if largest >= 2**32:
        return "tensors beyond 2^32 bytes (the shaders index with u32)"
    return None


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.wgsl import WgslStateSlab, _device, recurrence

    init = p.initial_state
    live = [s for s in p.spans if s.slot >= 0]
    if isinstance(init, WgslStateSlab):
        o = recurrence(p, init.buffer, [s.slot for s in live])
        return _finish(p, o), init
    tail = (p.Hv, p.K, p.V) if p.state_layout == "kv" else (p.Hv, p.V, p.K)
    if p.in_place:                       # a torch slab: run on a device copy of the live rows
        slots = torch.tensor([s.slot for s in live], dtype=torch.int64, device=init.device)
        state = _device.upload(init.index_select(0, slots))
    else:
        state = _device.upload(init) if init is not None else _device.zeros(p.N * _numel(tail) * 4)
    rows = len(live) if p.in_place else p.N
    o = recurrence(p, state, list(range(rows)) if p.in_place else [s.slot for s in live])
    nbytes = rows * _numel(tail) * 4
    final = (torch.frombuffer(bytearray(_device.download(state, nbytes)), dtype=torch.float32)
             if nbytes else torch.zeros(0)).view(rows, *tail).to(p.device)
    if not p.in_place:
        return _finish(p, o), final
    if live:                             # only after the dispatch succeeded: a failed call leaves the slab
        init.index_copy_(0, slots, final)
    return _finish(p, o), init


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _finish(p: Problem, o: torch.Tensor) -> torch.Tensor:
    return o.to(p.device, p.v.dtype)
