"""The shadow mode (``DELTARULE_VLLM_SHADOW=PATH``): every core call checked against float64
twins — the convolution against `deltarule.conv.reference_conv1d_slab`, the recurrence against
the ``reference`` backend on the same inputs and a copy of the rows it reads — one JSON line
per call appended to PATH (with tensor parallelism every rank appends its own lines, naming
its rank, process and value heads)."""

from __future__ import annotations

import json
import os

import torch

from ... import api
from ...conv import reference_conv1d_slab
from .steps import Part, accepted_of, offsets

SHADOW_ENV = "DELTARULE_VLLM_SHADOW"
SHADOW_TOL = {torch.float32: 5e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rows_used(part: Part) -> torch.Tensor:
    """[R] int64, sorted: the slab rows the part's calls read or write (copied before the call)."""
    rows = set(part.layout["read_rows"]) | set(part.layout["write_rows"]) | set(part.state_indices.flatten().tolist())
    return torch.tensor(sorted(r for r in rows if r >= 0), dtype=torch.int64)


def record(path, layer, part, x, y, qkv, o, conv_state, ssm, before, weight, inputs) -> None:
    """The float64 check of one call: one JSON line appended to `path`.

    `before` holds the rows the call reads or writes (`rows_used`) and their conv-state and
    state copies from before the call; the twins run on compact slabs of those rows."""
    from ...tools.check import STORE_TOL, rel_err
    used, conv_before, ssm_before = before
    where = {int(r): i for i, r in enumerate(used.tolist())}
    layout = dict(part.layout, read_rows=[where.get(r, 0) for r in part.layout["read_rows"]],
                  write_rows=[where.get(r, 0) for r in part.layout["write_rows"]])
    ref_y, ref_conv = reference_conv1d_slab(x, weight, layer.conv1d.bias, conv_before, activation=layer.activation,
                                            **layout)
    state = ssm_before.clone()
    indices = part.state_indices.clone()
    indices[indices >= 0] = torch.tensor([where[int(r)] for r in indices[indices >= 0].tolist()], dtype=torch.int64)
    zero = [where[int(r)] for r in part.zero_rows.tolist()] if part.zero_rows is not None else []
    state[zero] = 0
    ref_o, ref_state = api.linear_attention(*qkv, initial_state=state, cu_seqlens=offsets(part.layout["lengths"]),
                                            state_indices=indices, num_accepted_tokens=accepted_of(part.layout),
                                            backend="reference", **inputs)
    tol = SHADOW_TOL[x.dtype]
    conv_rows = torch.tensor([where[int(r)] for r in part.conv.write_rows.tolist()], dtype=torch.int64)
    rows = torch.tensor([where[int(r)] for r in part.rows.tolist()], dtype=torch.int64)
    pairs = {"conv": (torch.cat(y, dim=1), ref_y), "conv_state": (conv_state[used][conv_rows], ref_conv[conv_rows]),
             "o": (o, ref_o), "state": (ssm[used][rows], ref_state[rows])}
    errors = {name: rel_err(got, ref.double().numpy()) for name, (got, ref) in pairs.items()}
    limits = {"conv": tol, "conv_state": 1e-7, "o": tol, "state": tol + STORE_TOL[ssm.dtype]}
    line = dict(layer=layer.prefix, rank=_rank(), pid=os.getpid(), heads=ssm.shape[1],
                tokens=part.count, sequences=len(part.layout["lengths"]),
                speculative="accepted" in part.layout, dtype=str(x.dtype), state_dtype=str(ssm.dtype),
                errors=errors, limits=limits, ok=all(errors[name] <= limits[name] for name in errors))
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _rank() -> int | None:
    """This process's tensor-parallel rank in vLLM (None outside a vLLM worker)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no vLLM, or its groups not initialised (a call outside an engine)
        return None
