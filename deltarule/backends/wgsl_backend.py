"""The `wgsl` backend: WGSL compute shaders on any WebGPU adapter, through wgpu-py.

Inputs are torch tensors (any device) copied to the WebGPU device in their
own dtype; the shaders (`deltarule/kernels/wgsl/`: the fused recurrence, and
the chunked prefill for calls with a sequence of at least
`chunked.MIN_TOKENS` tokens) apply the raw-gate arm, beta_sigmoid and the
L2 norm themselves. The state runs in
place in one float32 device buffer: a copy of `initial_state` (or zeros), the
gathered read rows of a torch slab (plus one row per per-token store of a
speculative plan), or a `WgslStateSlab` that never leaves the device. 16-bit
torch states are widened on the way up and rounded to nearest even on the
way back. Outputs come back to `q`'s device as torch tensors. A compact
`capture` runs the recurrence (token by token) with the capture in a device
buffer, copied back into the caller's tensor after the call.
"""

from __future__ import annotations

import numpy as np
import torch

from ..problem import Problem
from ._features import EVERYTHING

NAME = "wgsl"
DESCRIPTION = "WGSL compute shaders through WebGPU (wgpu): fused recurrence, device-resident state slab"
SUPPORTS = dict(
    EVERYTHING,
    dtypes="float32, float16, bfloat16 inputs (16-bit read as packed words: no shader-f16 needed); "
           "float32 state in the shader (bfloat16 / float16 torch states converted on the host)",
    devices="any WebGPU adapter (Vulkan, Metal, D3D12; lavapipe on CPU); torch tensors on any device "
            "are copied to it, a WgslStateSlab stays there",
    note="prefill: chunked (WY) passes for calls with a sequence of >= 128 tokens "
         "(kernels/wgsl/chunked.py, MIN_TOKENS; chunk_size rounded up to a power of two in [16, 64]), "
         "the fused recurrence for shorter calls, decode and speculative plans; speculative plans up to "
         "32768 tokens per sequence; compact capture on the fused recurrence (one storage buffer more); "
         "not in auto's order",
    gradients="none (inputs that require grad are declined)",
)


def unavailable() -> str | None:
    """None when the backend runs here, else why not and what to do about it."""
    from ..kernels.wgsl import unavailable_reason

    reason = unavailable_reason()
    if reason is not None and "install" not in reason:
        # wgpu's own error when no driver answers: say how a machine without a GPU gets one
        reason += ("; on a machine without a GPU install Mesa's lavapipe: "
                   "apt-get install mesa-vulkan-drivers")
    return reason


def available() -> bool:
    return unavailable() is None


def supports(p: Problem) -> str | None:
    from ..kernels.wgsl import _device, recurrent

    if p.requires_grad:
        return "no backward kernel (forward only)"
    gpu = _device.gpu()
    need = recurrent.bindings_needed(p)
    if need > gpu.max_storage_buffers:
        return f"needs {need} storage buffers per shader stage, the adapter allows {gpu.max_storage_buffers}"
    live = sum(s.live for s in p.spans)
    if live > gpu.max_workgroups:
        return f"{live} sequences: more than the adapter's {gpu.max_workgroups} workgroups per dimension"
    if p.plan.speculative and p.max_len > recurrent.SEGMENT:
        return f"a speculative plan with a sequence longer than {recurrent.SEGMENT} tokens (one dispatch each)"
    state_rows = _buffer_rows(p)
    captured = p.capture.numel() if p.capture is not None else 0
    largest = 4 * max(p.B * p.T * p.Ho * p.V, p.B * p.T * p.Hq * p.K, state_rows * p.Hv * p.K * p.V, captured)
    if largest > gpu.max_binding_bytes:
        return f"a {largest}-byte buffer: more than the adapter's {gpu.max_binding_bytes}-byte binding limit"
    if largest >= 2**32:
        return "tensors beyond 2^32 bytes (the shaders index with u32)"
    return None


def _buffer_rows(p: Problem) -> int:
    """Rows of the device state buffer: the slab's (a device slab), the live read rows plus the
    per-token stores (a torch slab), or one per sequence."""
    if p.in_place:
        if not isinstance(p.initial_state, torch.Tensor):
            return p.initial_state.shape[0]
        return sum(s.live for s in p.spans) + len(p.plan.token_writes()[2])
    return p.N


def _forward(p: Problem, state, rows: list[int], token_rows: np.ndarray | None, capture) -> torch.Tensor:
    """The chunked form where it wins (long sequences, `chunked.wins`; never for a token-serial
    call: per-token stores or a capture), else the recurrence."""
    from ..kernels.wgsl import chunked, recurrence

    if not p.token_serial and chunked.wins(p):
        return chunked.chunked(p, state, rows)
    return recurrence(p, state, rows, token_rows, capture)


def _capture_buffer(p: Problem):
    """The device copy of `p.capture` (None without one): the entries the shader does not write
    come back as the caller's."""
    from ..kernels.wgsl import _device

    return None if p.capture is None else _device.upload(p.capture)


def _write_capture(p: Problem, buffer) -> None:
    """`p.capture` <- the device buffer (IN PLACE), once the call has succeeded."""
    from ..kernels.wgsl import _device

    if buffer is None or not p.capture.numel():
        return
    raw = bytearray(_device.download(buffer, p.capture.numel() * 4))
    p.capture.copy_(torch.frombuffer(raw, dtype=torch.float32).view(p.capture.shape))


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.wgsl import _device
    from .wgsl_slab import WgslStateSlab
    from ..kernels.wgsl.recurrent import NO_ROW

    init, plan = p.initial_state, p.plan
    live = [n for n, s in enumerate(p.spans) if s.live]
    capture = _capture_buffer(p)
    if isinstance(init, WgslStateSlab):
        # with per-token stores, a sequence without tokens stores nothing and reads no row (in the
        # same dispatch another sequence may store into the row it names); a verify call's plan
        # (a capture) has per-token rows that store nothing
        reads = [s.read if s.length or not plan.speculative else NO_ROW for s in (p.spans[n] for n in live)]
        o = _forward(p, init.buffer, reads, plan.token_rows[live] if plan.speculative else None, capture)
        _write_capture(p, capture)
        return _finish(p, o), init
    tail = (p.Hv, p.K, p.V) if p.state_layout == "kv" else (p.Hv, p.V, p.K)
    rows = _buffer_rows(p)
    if p.in_place:
        # a torch slab: run on a float32 device copy of the live read rows, then one row per store
        read_rows = torch.tensor([p.spans[n].read for n in live], dtype=torch.int64, device=init.device)
        gathered = init.index_select(0, read_rows).to(torch.float32)
        stores = torch.zeros(rows - len(live), *tail)
        state = _device.upload(torch.cat([gathered.cpu(), stores]))
        token_rows = None
        if plan.speculative:
            token_rows = np.full(plan.token_rows[live].shape, NO_ROW, dtype=np.uint32)
            where = {n: i for i, n in enumerate(live)}
            sequences, tokens, _ = plan.token_writes()
            for j, (n, t) in enumerate(zip(sequences.tolist(), tokens.tolist())):
                token_rows[where[n], t] = len(live) + j
        o = _forward(p, state, list(range(len(live))), token_rows, capture)
    else:
        upload = init.to(torch.float32) if init is not None else None
        state = _device.upload(upload) if upload is not None else _device.zeros(p.N * _numel(tail) * 4)
        o = _forward(p, state, [p.spans[n].read for n in live], None, capture)
    nbytes = rows * _numel(tail) * 4
    final = (torch.frombuffer(bytearray(_device.download(state, nbytes)), dtype=torch.float32)
             if nbytes else torch.zeros(0)).view(rows, *tail).to(p.device)
    _write_capture(p, capture)
    if not p.in_place:
        return _finish(p, o), final.to(p.state_dtype)
    # only after the dispatch succeeded: a failed call leaves the slab as it was
    finals = torch.zeros(p.N, *tail, device=p.device)
    finals[live] = final[: len(live)]
    plan.store(init, None if plan.speculative else finals, final[len(live):])
    return _finish(p, o), init


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _finish(p: Problem, o: torch.Tensor) -> torch.Tensor:
    return o.to(p.device, p.v.dtype)
