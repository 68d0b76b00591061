"""The prepared WGSL check on a lent GPU: correctness, then prefill / decode beside Triton.

    python benchmarks/wgsl_gpu.py             # a CUDA GPU with a WebGPU (Vulkan) adapter
    python benchmarks/wgsl_gpu.py --dry-run   # CPU / lavapipe, tiny shapes, the torch backend
                                              # in Triton's place: exercises every code path

Sections, each guarded (an exception is printed and the next section runs):

1. environment: the WebGPU adapter, torch / wgpu versions, the CUDA device;
2. correctness: small random cases (every rule, g / gk / g+gk, beta / erase+write, GVA, GQA,
   varlen with an empty request, torch slab and WgslStateSlab, fp32 / fp16 / bf16) through
   `linear_attention(..., backend="wgsl")`, relative error against the float64 reference;
3. prefill: Qwen3-Next shapes (Hq = Hk = 16, Hv = 32, K = V = 128), wall time per call with
   the inputs on the host (the wgsl call path) beside Triton with the inputs on the GPU;
4. decode: batch 1, 64, 256; wgsl on a device-resident WgslStateSlab, Triton on a CUDA slab;
   GB/s count the state read and written once, 2 N Hv K V 4 bytes per step;
5. targets: WGSL decode within 1.5x of Triton decode (ratio = Triton time / WGSL time).

Timings are medians of wall-clock repetitions after a warm-up (each call waits for its
results: the output comes back to torch). `--out DIR` writes DIR/wgsl_gpu.json and
DIR/wgsl_gpu.md (default $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..")))

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.tools.check import expected, rel_err  # noqa: E402
from deltarule import WgslStateSlab  # noqa: E402
from deltarule.kernels.wgsl import _device  # noqa: E402

TOL = {"float32": 5e-5, "float16": 1e-2, "bfloat16": 1e-2}
TARGET_DECODE_RATIO = 1 / 1.5


def shapes(dry: bool) -> dict:
    if dry:
        return dict(heads=dict(Hq=2, Hk=2, Hv=4, K=32, V=32), prefill_T=[64], decode_B=[1, 4], reps=3,
                    check_T=9, check_dtypes=("float32", "bfloat16"))
    return dict(heads=dict(Hq=16, Hk=16, Hv=32, K=128, V=128), prefill_T=[4096, 16384],
                decode_B=[1, 64, 256], reps=20, check_T=33, check_dtypes=("float32", "float16", "bfloat16"))


def median_seconds(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Report:
    def __init__(self, out_dir: str | None):
        self.out_dir, self.lines, self.data = out_dir, [], {}

    def section(self, name: str):
        self.say(f"\n== {name} ==")

    def say(self, line: str):
        print(line, flush=True)
        self.lines.append(line)

    def save(self):
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "wgsl_gpu.md"), "w") as f:
            f.write("```\n" + "\n".join(self.lines) + "\n```\n")
        with open(os.path.join(self.out_dir, "wgsl_gpu.json"), "w") as f:
            json.dump(self.data, f, indent=1)


def environment(r: Report, peer: str, device: str):
    gpu = _device.gpu()
    import wgpu
    r.say(f"adapter: {gpu.adapter}")
    r.say(f"torch {torch.__version__}  wgpu {wgpu.__version__}  peer backend: {peer} on {device}")
    if device == "cuda":
        r.say(f"cuda device: {torch.cuda.get_device_name()}")
    r.data["environment"] = dict(adapter=gpu.adapter, peer=peer)


CORRECTNESS = [
    dict(rule="linear"), dict(rule="gated", decay="gk"), dict(rule="delta", update="erase_write"),
    dict(decay="g"), dict(decay="gk"), dict(decay="g+gk", update="erase_write"),
    dict(Hq=2, Hk=2, Hv=8, K=100), dict(Hq=8, Hk=2, Hv=2), dict(qk_l2norm=True, raw_gate=True, beta_sigmoid=True),
    dict(B=1, T=40, cu_seqlens=[0, 9, 9, 40], initial_state=True),
    dict(B=3, initial_state=True, state_indices=[2, -1, 0], num_slots=4, state_layout="vk"),
]


def correctness(r: Report, sz: dict):
    failed = 0
    r.say(f"{'case':<76} {'dtype':<9} {'err(o)':>9} {'err(S)':>9}  result")
    for i, over in enumerate(CORRECTNESS):
        case = dict(name=f"c{i}", seed=300 + i, B=2, T=sz["check_T"], Hq=4, Hk=4, Hv=4, K=64, V=48, rule="gated_delta")
        case.update(over)
        for dtype in sz["check_dtypes"]:
            args = cases.make_inputs(case, dtype)
            ref_o, ref_s = expected(args)
            o, s = deltarule.linear_attention(**args, backend="wgsl")
            e_o, e_s = rel_err(o, ref_o), rel_err(s, ref_s)
            ok = max(e_o, e_s) <= TOL[dtype]
            failed += not ok
            label = ",".join(f"{k}={v}" for k, v in over.items())
            r.say(f"{label:<76} {dtype:<9} {e_o:9.2e} {e_s:9.2e}  {'pass' if ok else 'FAIL'}")
    r.data["correctness_failed"] = failed


def _qwen_inputs(B: int, T: int, heads: dict, seed: int) -> dict:
    case = dict(name="bench", seed=seed, B=B, T=T, rule="gated_delta", **heads)
    return cases.make_inputs(case, "bfloat16")


def prefill(r: Report, sz: dict, peer: str, device: str, sync):
    r.say(f"{'T':>7} {'wgsl ms':>10} {peer + ' ms':>12} {'ratio':>7}")
    rows = []
    for T in sz["prefill_T"]:
        args = _qwen_inputs(1, T, sz["heads"], seed=T)
        on_peer = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in args.items()}
        t_w = median_seconds(lambda: deltarule.linear_attention(**args, backend="wgsl"), sz["reps"], lambda: None)
        t_p = median_seconds(lambda: deltarule.linear_attention(**on_peer, backend=peer), sz["reps"], sync)
        rows.append(dict(T=T, wgsl_s=t_w, peer_s=t_p))
        r.say(f"{T:>7} {t_w * 1e3:10.2f} {t_p * 1e3:12.2f} {t_p / t_w:7.2f}")
    r.data["prefill"] = rows


def decode(r: Report, sz: dict, peer: str, device: str, sync):
    h = sz["heads"]
    r.say(f"{'B':>5} {'wgsl ms':>10} {'GB/s':>8} {peer + ' ms':>12} {'GB/s':>8} {'ratio':>7}")
    rows = []
    for B in sz["decode_B"]:
        args = _qwen_inputs(B, 1, h, seed=B)
        state = torch.randn(B, h["Hv"], h["K"], h["V"]) * 0.1
        idx = torch.arange(B, dtype=torch.int32)
        slab = WgslStateSlab.from_tensor(state)
        w_args = dict(args, initial_state=slab, state_indices=idx)
        p_args = {n: (x.to(device) if isinstance(x, torch.Tensor) else x)
                  for n, x in dict(args, initial_state=state.clone(), state_indices=idx).items()}
        t_w = median_seconds(lambda: deltarule.linear_attention(**w_args, backend="wgsl"), sz["reps"], lambda: None)
        t_p = median_seconds(lambda: deltarule.linear_attention(**p_args, backend=peer), sz["reps"], sync)
        nbytes = 2 * B * h["Hv"] * h["K"] * h["V"] * 4
        rows.append(dict(B=B, wgsl_s=t_w, peer_s=t_p, wgsl_GBps=nbytes / t_w / 1e9, peer_GBps=nbytes / t_p / 1e9))
        r.say(f"{B:>5} {t_w * 1e3:10.3f} {nbytes / t_w / 1e9:8.1f} {t_p * 1e3:12.3f} {nbytes / t_p / 1e9:8.1f} "
              f"{t_p / t_w:7.2f}")
    r.data["decode"] = rows


def targets(r: Report):
    rows = r.data.get("decode", [])
    worst = min((x["peer_s"] / x["wgsl_s"] for x in rows), default=float("nan"))
    verdict = "PASS" if worst >= TARGET_DECODE_RATIO else "MISS"
    r.say(f"WGSL decode within 1.5x of the peer (worst ratio {worst:.2f}, need >= {TARGET_DECODE_RATIO:.2f}): {verdict}")
    if r.data.get("correctness_failed"):
        r.say(f"correctness: {r.data['correctness_failed']} FAIL")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU / lavapipe, tiny shapes, torch in Triton's place")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="write wgsl_gpu.json / wgsl_gpu.md here")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    peer, device = ("torch", "cpu") if dry else ("triton", "cuda")
    sync = (lambda: None) if dry else torch.cuda.synchronize
    sz = shapes(dry)
    r = Report(args.out)
    sections = [("environment", lambda: environment(r, peer, device)), ("correctness", lambda: correctness(r, sz)),
                ("prefill", lambda: prefill(r, sz, peer, device, sync)),
                ("decode", lambda: decode(r, sz, peer, device, sync)), ("targets", lambda: targets(r))]
    errors = 0
    for name, run in sections:
        r.section(name)
        try:
            run()
        except Exception:
            errors += 1
            r.say(traceback.format_exc())
        r.save()
    return 1 if errors or r.data.get("correctness_failed") else 0


if __name__ == "__main__":
    sys.exit(main())
