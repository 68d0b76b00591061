"""Compile every Triton kernel variant the `triton` backend launches for an NVIDIA target, no GPU needed.

The interpreter (TRITON_INTERPRET=1, how the tests run the kernels on CPU) does not
type-check or lower anything: a kernel that passes every test there can still fail to
compile for a GPU. This script runs Triton's real compiler (TTIR -> TTGIR -> LLVM -> PTX ->
cubin through the ptxas bundled with triton) for sm_90 (H100 / H200) on the CPU and prints,
per variant, the compile time and the shared memory the kernel needs (the limit per block
on sm_90 is 227 KiB)::

    python benchmarks/triton_aot.py                 # all variants, K = V = 128 (minutes on 2 cores)
    python benchmarks/triton_aot.py --only recurrent,cumsum --K 32 --V 32   # a fast subset
    python benchmarks/triton_aot.py --only grad                              # the gradient kernels

Exit status 1 if a variant fails to compile or needs more shared memory than the target has.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)          # the real compiler, not the interpreter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..")))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deltarule.kernels.triton import backward as tb  # noqa: E402
from deltarule.kernels.triton import chunked as tc  # noqa: E402
from deltarule.kernels.triton import recurrent as tr  # noqa: E402

SHARED_LIMIT = {90: 232448, 80: 166912, 89: 101376}      # bytes per block (opt-in maximum)
INTS = ("L", "H", "Hk", "Hq", "K", "V", "NC", "W", "B", "T", "CS", "C")
NO_SEQ = {"seq": None, "chunks": None}
STRIDES = ("s0_n", "s0_h", "s0_k", "s0_v", "s_n", "s_h", "s_k", "s_v", "c_n", "c_key", "c_delta")


def variants(K: int, V: int, dt: str):
    """(kernel label, jit function, constexprs, pointer types) for every gate form the backend
    launches; the fused preprocessing (raw-gate arm, beta_sigmoid, qk_l2norm) is on in one
    variant of each kernel (Qwen3-Next's call) and off in the others; pointer types other than
    float32 (a 16-bit state) are named in the last element."""
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    rec_BK, rec_BV = triton.next_power_of_2(K), min(64, triton.next_power_of_2(V))
    dot_dt = tl.float32 if dt == "fp32" else tl.bfloat16      # as `triton_common.dot_dtype`
    chunk = dict(BT=tc.CHUNK, BK=BK, DT=dot_dt)
    LEVELS = (tc.CHUNK // tc.SUB).bit_length() - 1
    plain = dict(RAW=False, A=None, dtb=None)
    fused = dict(RAW=True)
    scan = dict(BT=tc.CHUNK, BK=BK)
    out = [("cumsum g+gk", tc._cumsum_kernel, dict(scan, VARLEN=False, HAS_G=True, **plain, seq=None, chunks=None)),
           ("cumsum raw varlen", tc._cumsum_kernel, dict(scan, VARLEN=True, HAS_G=False, g=None, **fused))]
    for per_key in (False, True):
        decay = dict(HAS_DECAY=True, DECAY_PER_KEY=per_key, **({} if per_key else {"gc": None}))
        for erase_pk in (False, True):
            pre = plain if erase_pk else fused           # beta: Qwen3-Next's call, everything fused
            out.append((f"intra decay={'gk' if per_key else 'g'} {'erase/write' if erase_pk else 'beta fused'}",
                        tc._intra_kernel,
                        dict(chunk, **decay, **pre, ERASE_PER_KEY=erase_pk, WRITE_PER_VALUE=erase_pk,
                             SIGMOID=not erase_pk, L2NORM=not erase_pk,
                             BC=tc.SUB, LEVELS=LEVELS, BV=BV, VARLEN=erase_pk, **({} if erase_pk else NO_SEQ))))
        for has_index in (False, True):         # the slab variant also varlen and fused
            out.append((f"state decay={'gk' if per_key else 'g'} {'slab varlen fused' if has_index else 'state'}",
                        tc._state_kernel,
                        dict(chunk, **decay, **(fused if has_index else plain), L2NORM=has_index,
                             HAS_ERASE=True, HAS_INIT=True, HAS_INDEX=has_index, BV=BV, VARLEN=has_index,
                             **({} if has_index else {"idx": None, "seq": None}))))
        for varlen in (False, True):
            out.append((f"output decay={'gk' if per_key else 'g'} G=2{' varlen fused' if varlen else ''}",
                        tc._output_kernel,
                        dict(chunk, G=2, **decay, **(fused if varlen else plain), L2NORM=varlen,
                             BC=tc.SUB, BV=BV, VARLEN=varlen, **({} if varlen else NO_SEQ))))
        for erase_pk in (False, True):
            out.append((f"recurrent decay={'gk' if per_key else 'g'} {'erase/write' if erase_pk else 'beta fused'} "
                        f"slab{' varlen capture' if erase_pk else ''}",
                        tr._recurrent_kernel,
                        dict(G=1, HAS_INIT=True, HAS_INDEX=True, VARLEN=erase_pk, **({} if erase_pk else {"seq": None}),
                             HAS_G=not per_key, HAS_GK=per_key, **({"g": None} if per_key else {"gk": None}),
                             **(plain if erase_pk else fused), SIGMOID=not erase_pk, L2NORM=not erase_pk,
                             HAS_ERASE=True, ERASE_PER_KEY=erase_pk, HAS_WRITE=True, WRITE_PER_VALUE=erase_pk,
                             TOKEN_ROWS=False, tok=None, HAS_CAPTURE=erase_pk,
                             **({} if erase_pk else {"cap": None}), BK=rec_BK, BV=rec_BV)))
    # speculative decoding: per-token state stores into a bfloat16 slab (vLLM's verify step)
    out.append(("recurrent speculative bf16 slab", tr._recurrent_kernel,
                dict(G=1, HAS_INIT=True, HAS_INDEX=True, VARLEN=True, HAS_G=True, HAS_GK=False, gk=None, **fused,
                     SIGMOID=True, L2NORM=True, HAS_ERASE=True, ERASE_PER_KEY=False, HAS_WRITE=True,
                     WRITE_PER_VALUE=False, TOKEN_ROWS=True, HAS_CAPTURE=False, cap=None, BK=rec_BK, BV=rec_BV),
                {"S0": "*bf16", "S": "*bf16"}))
    # a bfloat16 state through the chunked state kernel
    out.append(("state decay=g bf16 state", tc._state_kernel,
                dict(chunk, HAS_DECAY=True, DECAY_PER_KEY=False, gc=None, **plain, L2NORM=False, HAS_ERASE=True,
                     HAS_INIT=True, HAS_INDEX=False, BV=BV, VARLEN=False, idx=None, seq=None),
                {"S0": "*bf16", "S": "*bf16"}))
    out.append(("intra no decay beta", tc._intra_kernel,
                dict(chunk, HAS_DECAY=False, DECAY_PER_KEY=False, **plain, ERASE_PER_KEY=False, WRITE_PER_VALUE=False,
                     SIGMOID=False, L2NORM=False, BC=tc.SUB, LEVELS=LEVELS, BV=BV, g=None, gc=None, VARLEN=False,
                     **NO_SEQ)))
    out.append(("state linear (no decay, no erase)", tc._state_kernel,
                dict(chunk, HAS_DECAY=False, DECAY_PER_KEY=False, **plain, HAS_ERASE=False, L2NORM=False,
                     HAS_INIT=False, HAS_INDEX=False, BV=BV, g=None, gc=None, y=None, S0=None, idx=None,
                     VARLEN=False, seq=None)))
    # the gradient path (kernels/triton/backward.py): float32 operands, preprocessing done in torch
    grad_BK, grad_BV = tb._tiles(K, V)
    f32_ops = {"q": "*fp32", "k": "*fp32", "v": "*fp32", "seq": "*i64"}
    for per_key in (False, True):
        gates = dict(HAS_G=True, HAS_GK=per_key, HAS_ERASE=True, ERASE_PER_KEY=per_key, HAS_WRITE=True,
                     WRITE_PER_VALUE=per_key, BT=tb.CHECKPOINT, BK=grad_BK, BV=grad_BV, G=2 if per_key else 1)
        form = "decay=g+gk erase/write G=2" if per_key else "decay=g beta"
        out.append((f"grad forward {form}", tb._forward_kernel, dict(gates, HAS_INIT=True), f32_ops))
        out.append((f"grad backward {form}", tb._backward_kernel,
                    dict(gates, HAS_DS=True, HAS_DS0=True, BV=tb._tiles(K, V, tb.BACKWARD_TILE)[1]), f32_ops))
    return [v if len(v) == 4 else (*v, {}) for v in out]


def compile_one(fn, consts: dict, dt: str, target, num_warps: int, pointers: dict):
    types = {n: "i32" for n in INTS}
    types.update({n: "i64" for n in STRIDES})
    types.update(scale="fp32", eps="fp32", idx="*i64", tok="*i64")
    for n in ("q", "k", "v"):
        types[n] = "*" + dt
    types.update(pointers)                      # a variant's own pointer types win (float32 q, k, v)
    missing = [n for n, p in zip(fn.arg_names, fn.params) if p.is_constexpr and n not in consts]
    if missing:
        raise ValueError(f"constexpr parameters not given: {missing}")
    sig = {n: ("constexpr" if n in consts else types.get(n, "*fp32")) for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": num_warps})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", help="q, k, v element type: bf16, fp16 or fp32")
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: sm_90)")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated label prefixes (e.g. recurrent,cumsum)")
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch)
    wanted = [w for w in args.only.split(",") if w]
    failures = 0
    print(f"triton {triton.__version__}, target sm_{args.arch}, K = {args.K}, V = {args.V}, "
          f"q/k/v {args.dtype}, num_warps {args.num_warps}", flush=True)
    for label, fn, consts, pointers in variants(args.K, args.V, args.dtype):
        if wanted and not any(label.startswith(w) for w in wanted):
            continue
        t0 = time.perf_counter()
        try:
            kernel = compile_one(fn, consts, args.dtype, target, args.num_warps, pointers)
            shared = kernel.metadata.shared
            ok = limit is None or shared <= limit
            failures += not ok
            print(f"{label:<45} {time.perf_counter() - t0:7.1f} s   shared {shared / 1024:6.1f} KiB"
                  f"{'' if ok else '   OVER THE LIMIT'}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"{label:<45} FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            traceback.print_exc(limit=3)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
