"""The one prepared GPU check: correctness of every kernel, then prefill / decode timings beside fla.

Run on a machine with a CUDA GPU (docs/gpu.md has the exact device-tool command)::

    python benchmarks/gpu.py            # full run, a time budget of --budget seconds (default 360)
    python benchmarks/gpu.py --quick    # a subset, budget 150 s
    python benchmarks/gpu.py --dry-run  # CPU, tiny shapes, torch backend in place of triton and
                                        # deltarule.contracts.fla in place of fla: exercises this
                                        # script's code paths without a GPU

Sections, in order, each guarded (an exception is printed and the next section runs):

1. environment: GPU, torch / triton / fla versions;
2. HBM copy bandwidth: a large device-to-device copy timed with do_bench (bytes read + written);
3. correctness: small random cases (every rule, g / gk / g+gk, beta / erase+write, GVA, GQA,
   varlen with an empty sequence, slab with padding, fp32 / bf16; the chunked kernels past 64
   tokens with per-key decay, erase / write and strong decay, also at K = V = 128) through
   `linear_attention(..., backend="triton")` with NaN-poisoned fresh memory
   (`torch.use_deterministic_algorithms` + `fill_uninitialized_memory`), relative error against
   the float64 reference (bounds: fp32 5e-5, bf16 1e-2, plus one 16-bit rounding for a 16-bit
   state); speculative plans, bfloat16 slabs and -inf resets too; "declined: <reason>" where the
   backend raises `deltarule.Unsupported`;
4. prefill timings (Qwen3-Next value heads 32 / 64, K = V = 128, T = 8192 / 32768 and varlen
   8 x 4096) and the KDA / GDN-2 family beside scalar GDN, each beside fla's chunk_gated_delta_rule /
   chunk_kda / chunk_gdn2;
5. decode timings (batch 1, 64, 256, 1024);
6. targets, PASS / MISS.

Timings are `triton.testing.do_bench` medians (L2 flushed between calls); a call slower than
0.5 s is timed twice by CUDA events instead. Prefill TFLOP/s use docs/algorithm.md's chunked model,
FLOP = tokens * Hv * (6 K V + C (5 K + 3 V) + C^2 / 3) with C = 64 (about 165 kFLOP per token
and head at K = V = 128), for every implementation alike. Decode GB/s count the state read
and written once: 2 N Hv K V 4 bytes per step. "ratio" is fla time / deltarule time (> 1:
deltarule faster).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.join(HERE, "..") not in [os.path.normpath(p) for p in sys.path]:
    sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..")))

import deltarule  # noqa: E402
from deltarule import cases as _cases  # noqa: E402
from deltarule.tools.check import STORE_TOL, expected, rel_err  # noqa: E402

CHUNK = 64
TOL = {"float32": 5e-5, "bfloat16": 1e-2}
FLOP_FORMULA = "FLOP = tokens*Hv*(6*K*V + C*(5*K + 3*V) + C^2/3), C = 64 (docs/algorithm.md, section 6)"
BYTES_FORMULA = "bytes = 2*N*Hv*K*V*4 per decode step (fp32 state read + write)"
SLOW_CALL_S = 0.5
CORRECTNESS_SHARE = 0.3  # correctness cases stop at this share of the budget
PREFILL_SHARE = 0.75   # prefill timings stop at this share of the budget, leaving time for decode

SECTIONS = ("environment", "hbm copy bandwidth", "correctness", "prefill", "decode", "backward", "transformers",
            "targets")

# test.json cases for the correctness table: (name, dtypes). Every rule, g / gk / g+gk,
# beta / erase+write, GVA, GQA, varlen with an empty sequence, slab with padding, layouts,
# the raw-gate / sigmoid / l2norm arms; short (T <= 64, the fused recurrence) and long ones.
CORRECTNESS = [
    ("linear-B2-T65-H4-K32", ("float32", "bfloat16")),
    ("gqa2-B2-T3-Hq8-Hv4-K32-linear", ("float32",)),
    ("gated-B2-T65-H4-K32-g", ("float32", "bfloat16")),
    ("gated-B2-T65-H4-K32-gk", ("float32",)),
    ("delta-B2-T65-H4-K32-beta", ("float32",)),
    ("delta-B2-T1-H4-K32-state", ("float32",)),
    ("gdn-B2-T65-H4-K32-g-beta", ("float32", "bfloat16")),
    ("gdn-B2-T64-H4-K32-g-beta", ("float32",)),
    ("gdn-B3-T1-H4-K32-decode-state", ("float32", "bfloat16")),
    ("gdn-B2-T9-H4-K100-V60-g-beta", ("float32",)),
    ("kda-B2-T65-Hq4-Hv8-K100-gk", ("float32", "bfloat16")),
    ("kda-B2-T65-H4-K32-gk-T1", ("float32",)),
    ("rgdr-B2-T5-H4-K32-g+gk", ("float32",)),
    ("rgdr-B2-T65-H4-K32-g+gk", ("float32",)),
    ("gdn2-B1-T3-H4-K32-gk-erase-write-state", ("float32",)),
    ("gdn2-B2-T65-H4-K32-gk-erase-write", ("float32", "bfloat16")),
    ("delta-B2-T65-H4-K32-erase-write", ("float32",)),
    ("gva4-B1-T65-Hq2-Hv8-K32-gk", ("float32",)),
    ("gqa2-B2-T65-Hq8-Hv4-K32", ("float32", "bfloat16")),
    ("gdn-B2-T65-H4-K24-V40-state-vk", ("float32",)),
    ("varlen-T90-empty", ("float32",)),
    ("varlen-T70-gdn2", ("float32", "bfloat16")),
    ("ragged-B3-T65-seq_lens", ("float32",)),
    ("slab-B3-T20-indices", ("float32",)),
    ("slab-B2-T1-decode-vk", ("float32",)),
    ("slab-varlen-T50", ("float32",)),
    ("l2norm-B2-T65-H4-K32", ("float32",)),
    ("qwen-B1-T65-Hq2-Hv4-K32-l2norm-rawgate-sigmoid", ("float32",)),
    ("sigmoid-B2-T65-H4-K32-erase-write", ("float32",)),
    # the chunked kernels past 64 tokens: per-key decay, erase / write, strong decay, real tile sizes
    ("gdn2-B2-T65-H4-K32-g-erase-write", ("float32",)),
    ("rawgate-B2-T65-H4-K32-gk", ("float32",)),
    ("mqa-B2-T65-Hq4-Hv1-K32-gk", ("float32",)),
    ("varlen-T80-gqa-vk", ("float32",)),
    ("realistic-B1-T256-H2-K128-V128", ("float32", "bfloat16")),
    ("strong-B1-T8192-H2-K32-gk", ("float32",)),
    ("strong-B1-T1024-H2-K32-gdn2", ("float32",)),
    ("kda-B1-T300-Hq2-Hv4-K128-V128-gk", ("float32", "bfloat16")),
    ("gdn2-B1-T300-H2-K128-V128-slab-vk", ("float32", "bfloat16")),
    ("gdn2-B1-T200-H4-K128-V128-varlen-g+gk", ("float32",)),
    # serving: speculative plans (per-token rows, accepted-row reads, padding), 16-bit states, resets
    ("spec-B3-L4-accepted-gva", ("float32", "bfloat16")),
    ("spec-B4-L3-padding-seq_lens", ("float32",)),
    ("spec-varlen-empty-kda-vk", ("float32",)),
    ("spec-B2-L4-gdn2-bf16-state", ("float32",)),
    ("spec-long-B2-T70-g", ("float32",)),
    ("slab-bf16-B3-T1-decode", ("float32", "bfloat16")),
    ("state-bf16-B2-T65-H4-K32-g", ("float32",)),
    ("reset-B1-T100-g-minus-inf", ("float32",)),
    ("reset-B2-T80-gk-gdn2-minus-inf", ("float32",)),
]
QUICK_CORRECTNESS = {
    "linear-B2-T65-H4-K32", "gdn-B2-T65-H4-K32-g-beta", "gdn-B3-T1-H4-K32-decode-state",
    "kda-B2-T65-Hq4-Hv8-K100-gk", "rgdr-B2-T5-H4-K32-g+gk", "gdn2-B2-T65-H4-K32-gk-erase-write",
    "gqa2-B2-T65-Hq8-Hv4-K32", "varlen-T90-empty", "slab-B3-T20-indices",
    "strong-B1-T1024-H2-K32-gdn2", "kda-B1-T300-Hq2-Hv4-K128-V128-gk", "gdn2-B1-T300-H2-K128-V128-slab-vk",
    "spec-B3-L4-accepted-gva", "slab-bf16-B3-T1-decode", "reset-B1-T100-g-minus-inf",
}
# cases beside test.json's, at the tile sizes of the real models (K = V = 128: one [64, 128]
# per-key tile per chunk), through the slab in place and a vk layout
EXTRA_CASES = [
    {"name": "kda-B1-T300-Hq2-Hv4-K128-V128-gk", "seed": 31, "B": 1, "T": 300, "Hq": 2, "Hk": 2, "Hv": 4,
     "K": 128, "V": 128, "rule": "gated_delta", "decay": "gk", "initial_state": True},
    {"name": "gdn2-B1-T300-H2-K128-V128-slab-vk", "seed": 32, "B": 2, "T": 300, "Hq": 2, "Hk": 2, "Hv": 2,
     "K": 128, "V": 128, "rule": "gated_delta", "decay": "gk", "update": "erase_write", "initial_state": True,
     "state_indices": [3, -1], "num_slots": 4, "state_layout": "vk"},
    {"name": "gdn2-B1-T200-H4-K128-V128-varlen-g+gk", "seed": 33, "B": 1, "T": 200, "Hq": 4, "Hk": 4, "Hv": 4,
     "K": 128, "V": 128, "rule": "gated_delta", "decay": "g+gk", "update": "erase_write", "initial_state": True,
     "cu_seqlens": [0, 0, 130, 200], "decay_range": [-3.0, -0.01]},
]


# ---------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------

class Config:
    def __init__(self, args):
        self.dry = args.dry_run
        self.quick = args.quick
        self.device = torch.device("cpu" if self.dry else "cuda")
        if self.dry:
            torch.set_num_threads(1)   # tiny shapes: threads only contend on a busy CPU
        self.budget = args.budget if args.budget is not None else (60 if self.dry else 150 if self.quick else 360)
        self.start = time.perf_counter()
        # what stands for what: (label, backend) of deltarule's two lines; the peer
        self.primary = ("triton", "triton") if not self.dry else ("torch (as triton)", "torch")
        self.second = ("torch", "torch")
        self.peer_label = "fla" if not self.dry else "fla-contract (as fla)"
        self.dtype = torch.bfloat16 if not self.dry else torch.float32
        K = V = 128 if not self.dry else 16
        self.K, self.V = K, V
        if self.dry:
            self.copy_bytes = 8 << 20
            # prefill jobs in priority order: (shape, Hk, Hv, T or None, varlen lengths or None, kind)
            self.prefill = [
                ("qwen-v4-T128", 2, 4, 128, None, "gdn"),
                ("qwen-v4-varlen-2x64", 2, 4, None, [64, 64], "gdn"),
            ] + [("mha-v4-T128", 4, 4, 128, None, kind) for kind in ("gdn", "kda", "gdn2")]
            self.decode = [(2, 4, n) for n in (1, 4)]
            self.decode_heavy = 4
        else:
            self.copy_bytes = 2 << 30
            qwen = [(16, 32), (16, 64)] if not self.quick else [(16, 32)]
            Ts = (8192, 32768) if not self.quick else (8192,)
            # prefill jobs in priority order (what a budget overrun drops comes last):
            # (shape, Hk, Hv, T or None, varlen lengths or None, kind)
            self.prefill = []
            for hk, hv in qwen:
                self.prefill.append((f"qwen3-next-v{hv}-T8192", hk, hv, 8192, None, "gdn"))
                self.prefill.append((f"qwen3-next-v{hv}-varlen-8x4096", hk, hv, None, [4096] * 8, "gdn"))
                if hv == 32 or not self.quick:
                    self.prefill += [(f"mha-v{hv}-T8192", hv, hv, 8192, None, kind)
                                     for kind in ("gdn", "kda", "gdn2")]
                if 32768 in Ts:
                    self.prefill.append((f"qwen3-next-v{hv}-T32768", hk, hv, 32768, None, "gdn"))
            batches = (1, 64, 256, 1024) if not self.quick else (1, 256, 1024)
            self.decode = [(hk, hv, n) for hk, hv in qwen for n in batches]
            self.decode_heavy = 256
        self.correctness = [c for c in CORRECTNESS if not self.quick or c[0] in QUICK_CORRECTNESS]
        if self.dry:                   # the K = 128 cases are slow on a CPU
            self.correctness = [c for c in CORRECTNESS if c[0] in QUICK_CORRECTNESS and "K128" not in c[0]]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# ---------------------------------------------------------------------------
# output: printed tables, kept for --out
# ---------------------------------------------------------------------------

class Report:
    def __init__(self):
        self.lines: list[str] = []
        self.data: dict = {"sections": {}}

    def print(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)

    def header(self, title):
        self.print("")
        self.print(f"== {title} ==")

    def table(self, columns, rows):
        widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c))
                  for i, c in enumerate(columns)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        self.print(fmt.format(*columns))
        for r in rows:
            self.print(fmt.format(*[str(x) for x in r]))

    def write(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "gpu.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(out_dir, "gpu.md"), "w") as f:
            f.write("```\n" + "\n".join(self.lines) + "\n```\n")


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------

def sync(cfg):
    if cfg.device.type == "cuda":
        torch.cuda.synchronize()


def one_call_s(cfg, fn) -> float:
    if cfg.device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_s(cfg, fn) -> float:
    """Median seconds of `fn` (already warmed up by the caller)."""
    probe = one_call_s(cfg, fn)
    if probe > SLOW_CALL_S:
        return statistics.median([probe, one_call_s(cfg, fn)])
    if cfg.device.type == "cuda":
        from triton.testing import do_bench

        rep = 40 if cfg.quick else 80
        return do_bench(fn, warmup=10, rep=rep, return_mode="median") / 1e3
    samples = [one_call_s(cfg, fn) for _ in range(3)]
    return statistics.median(samples)


def free_memory(cfg):
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------

def section_environment(cfg, rep):
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "deltarule": deltarule.__version__, "dry_run": cfg.dry, "quick": cfg.quick,
           "budget_s": cfg.budget}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"absent ({e})"
    try:
        import fla
        env["fla"] = getattr(fla, "__version__", "?") + f" ({os.path.dirname(fla.__file__)})"
    except Exception as e:  # noqa: BLE001
        env["fla"] = f"absent ({type(e).__name__}: {e})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, " \
                     f"cc {p.major}.{p.minor}"
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = "none"
    env["device used"] = str(cfg.device)
    env["backends"] = ", ".join(f"{b['name']}{'' if b['available'] else ' (unavailable)'}"
                                for b in deltarule.backend_info())
    for k, v in env.items():
        rep.print(f"{k:<12} {v}")
    rep.data["environment"] = env
    if not cfg.dry and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: run with --dry-run on a CPU machine")


def section_copy(cfg, rep):
    n = cfg.copy_bytes
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=cfg.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(cfg)
    t = bench_s(cfg, lambda: dst.copy_(src))
    if not torch.equal(dst, src):
        raise AssertionError("copy mismatch")
    bw = 2 * n / t / 1e9
    rep.print(f"copy of {n / 2**30:.3f} GiB: {t * 1e3:.3f} ms median, {bw:.0f} GB/s (read + write)")
    rep.data["hbm_copy_GBps"] = bw
    src = dst = None            # frees the 2 x 2 GiB (a del would confuse linters about the lambda)
    free_memory(cfg)


def _fresh(case: dict, k: int) -> dict:
    c = copy.deepcopy(case)
    c["seed"] = int(c.get("seed", 0)) + 7919 * (k + 1) + int(time.time()) % 100000
    return c


@contextlib.contextmanager
def nan_poison():
    """Fresh torch allocations (outputs, workspaces) come back NaN-filled."""
    det = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def section_correctness(cfg, rep):
    by_name = {c["name"]: c for c in _cases.test_cases() + EXTRA_CASES}
    label, backend = cfg.primary
    rows, records, failed, declined = [], [], 0, 0
    import warnings

    for k, (name, dtypes) in enumerate(cfg.correctness):
        if name not in by_name:
            rows.append((name, "-", "-", "-", "-", "missing from test.json"))
            continue
        case = _fresh(by_name[name], k)
        for dtype in dtypes:
            rec = {"case": name, "seed": case["seed"], "dtype": dtype, "backend": label, "tol": TOL[dtype]}
            if cfg.elapsed() > cfg.budget * CORRECTNESS_SHARE:
                rec["result"] = f"skipped: past {cfg.budget * CORRECTNESS_SHARE:.0f} s of the budget"
                declined += 1
                rows.append((name, dtype, "-", "-", f"{TOL[dtype]:.0e}", rec["result"]))
                records.append(rec)
                continue
            try:
                args_cpu = _cases.make_inputs(case, dtype, "cpu")
                ref_o, ref_s = expected(args_cpu)
                args = {n: (x.to(cfg.device) if isinstance(x, torch.Tensor) else x) for n, x in args_cpu.items()}
                with nan_poison(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        o, s = deltarule.linear_attention(**args, backend=backend)
                        sync(cfg)
                    except deltarule.Unsupported as e:
                        rec["result"] = f"declined: {e}"
                        declined += 1
                        rows.append((name, dtype, "-", "-", f"{TOL[dtype]:.0e}", _short(rec["result"])))
                        records.append(rec)
                        continue
                e_o, e_s = rel_err(o, ref_o), rel_err(s, ref_s)
                init = args.get("initial_state")
                tol_state = TOL[dtype] + STORE_TOL[torch.float32 if init is None else init.dtype]
                ok = e_o <= TOL[dtype] and e_s <= tol_state and o.dtype == args["v"].dtype
                if args.get("state_indices") is not None and s is not args["initial_state"]:
                    ok = False
                    rec["note"] = "slab call did not return the slab itself"
                rec.update(err_o=e_o, err_state=e_s, result="pass" if ok else "FAIL")
                failed += not ok
                rows.append((name, dtype, f"{e_o:.2e}", f"{e_s:.2e}", f"{TOL[dtype]:.0e}", rec["result"]))
            except Exception as e:  # noqa: BLE001
                failed += 1
                rec["result"] = f"ERROR {type(e).__name__}: {e}"
                rows.append((name, dtype, "-", "-", f"{TOL[dtype]:.0e}", _short(rec["result"])))
            records.append(rec)
    with nan_poison():
        probe = torch.empty(1 << 16, device=cfg.device)
        poisoned = bool(torch.isnan(probe).all())
    del probe
    rep.print(f"backend {label!r}; fresh allocations NaN-poisoned (deterministic fill; torch.empty all NaN: "
              f"{poisoned}); fresh seeds; reference float64 on CPU")
    rep.table(("case", "dtype", "err(o)", "err(S)", "tol", "result"), rows)
    ran = len(records) - declined
    rep.print(f"{ran - failed} passed, {failed} failed, {declined} declined or skipped")
    rep.data["correctness"] = {"backend": label, "cases": records, "failed": failed, "declined": declined,
                               "poison_active": poisoned}


def _short(s, n=110):
    s = " ".join(str(s).split())
    s = re.sub(r"backend '\w+' declines this call: ", "", s)
    return s if len(s) <= n else s[: n - 3] + "..."


# --- inputs for timing (made on the device, never zeros) --------------------

def make_timing_inputs(cfg, *, Hk, Hv, T=None, seqs=None, N=1, kind="gdn", decode=False, seed=0):
    """Random inputs on the device. kind: gdn (scalar g, beta), kda (per-key g, beta),
    gdn2 (per-key g, erase, write). Decode: N sequences of one token from a random state."""
    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    dev, dt, K, V = cfg.device, cfg.dtype, cfg.K, cfg.V
    if seqs is not None:
        B, T = 1, sum(seqs)
        cu = torch.tensor([0] + list(_cumsum(seqs)), dtype=torch.int64, device=dev)
    else:
        B, cu = (N if decode else 1), None
        T = 1 if decode else T

    def randn(*s, dtype=dt):
        return torch.randn(*s, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    def uniform(lo, hi, *s, dtype=torch.float32):
        return (torch.rand(*s, generator=gen, device=dev, dtype=torch.float32) * (hi - lo) + lo).to(dtype)

    q = randn(B, T, Hk, K)
    k = torch.nn.functional.normalize(randn(B, T, Hk, K, dtype=torch.float32), dim=-1).to(dt)
    v = randn(B, T, Hv, V)
    x = {"q": q, "k": k, "v": v, "cu_seqlens": cu}
    if kind == "gdn":
        x["g"] = uniform(-0.2, -0.001, B, T, Hv)
        x["beta"] = uniform(0.0, 1.0, B, T, Hv, dtype=dt)
    else:
        x["gk"] = uniform(-0.2, -0.001, B, T, Hv, K)
        if kind == "kda":
            x["beta"] = uniform(0.0, 1.0, B, T, Hv, dtype=dt)
        else:
            x["erase"] = uniform(0.0, 1.0, B, T, Hv, K, dtype=dt)
            x["write"] = uniform(0.0, 1.0, B, T, Hv, V, dtype=dt)
    if decode:
        x["initial_state"] = randn(B, Hv, K, V, dtype=torch.float32) * 0.5
    return x


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def deltarule_call(x, backend):
    kw = {n: x[n] for n in ("g", "gk", "beta", "erase", "write", "initial_state", "cu_seqlens") if x.get(n) is not None}
    return lambda: deltarule.linear_attention(x["q"], x["k"], x["v"], rule="gated_delta", backend=backend, **kw)


def fla_functions(cfg):
    """fla's four functions, or deltarule's drop-ins with the same signatures in a dry run."""
    if cfg.dry:
        from deltarule.contracts import fla as m
        return m.chunk_gated_delta_rule, m.fused_recurrent_gated_delta_rule, m.chunk_kda, m.chunk_gdn2
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.gdn2 import chunk_gdn2
    from fla.ops.kda import chunk_kda
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda, chunk_gdn2


def fla_call(fns, x, kind, decode):
    chunk_gdn, fused_gdn, chunk_kda, chunk_gdn2 = fns
    common = {"initial_state": x.get("initial_state"), "output_final_state": True}
    if x.get("cu_seqlens") is not None:
        common["cu_seqlens"] = x["cu_seqlens"]
    q, k, v = x["q"], x["k"], x["v"]
    if decode:
        return lambda: fused_gdn(q, k, v, g=x["g"], beta=x["beta"], **common)
    if kind == "gdn":
        return lambda: chunk_gdn(q, k, v, x["g"], x["beta"], **common)
    if kind == "kda":
        return lambda: chunk_kda(q, k, v, x["gk"], x["beta"], **common)
    return lambda: chunk_gdn2(q, k, v, x["gk"], x["erase"], x["write"], **common)


def flops(tokens, Hv, K, V, C=CHUNK):
    return tokens * Hv * (6 * K * V + C * (5 * K + 3 * V) + C * C / 3)


def _diff(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den else float("nan")


def time_row(cfg, rep, label, make_fn, *, work, unit, ref_out=None, deadline=None):
    """Warm up (compile), check finiteness, time. Returns a result dict."""
    r = {"impl": label}
    deadline = cfg.budget if deadline is None else deadline
    if cfg.elapsed() > deadline:
        r["status"] = f"skipped: past {deadline:.0f} s of the {cfg.budget:.0f} s budget"
        return r
    try:
        fn = make_fn()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = fn()
            sync(cfg)
            r["first_call_s"] = time.perf_counter() - t0
            o = out[0]
            if not torch.isfinite(o.float()).all():
                r["status"] = "non-finite output"
            if ref_out is not None:
                r["diff_vs_ref"] = _diff(o, ref_out)
            t = bench_s(cfg, fn)
        r["time_s"] = t
        r["rate"] = work / t / (1e12 if unit == "TFLOP/s" else 1e9)
        r.setdefault("status", "ok")
        r["_out"] = o
    except deltarule.Unsupported as e:
        r["status"] = f"declined: {e}"
    except torch.cuda.OutOfMemoryError as e:  # noqa: F841
        r["status"] = "out of memory"
    except Exception as e:  # noqa: BLE001
        r["status"] = f"ERROR {type(e).__name__}: {e}"
        if os.environ.get("GPU_BENCH_TRACE"):
            traceback.print_exc()
    finally:
        free_memory(cfg)
    return r


def run_group(cfg, rep, shape, x, *, kind, decode, work, unit, fns, fns_error, deadline=None):
    """The three lines of one shape: deltarule primary, deltarule second, the peer."""
    results = []
    primary = time_row(cfg, rep, cfg.primary[0], lambda: deltarule_call(x, cfg.primary[1]), work=work, unit=unit,
                       deadline=deadline)
    ref = primary.pop("_out", None)
    results.append(primary)
    second = time_row(cfg, rep, cfg.second[0], lambda: deltarule_call(x, cfg.second[1]), work=work, unit=unit,
                      ref_out=ref, deadline=deadline)
    out2 = second.pop("_out", None)
    if ref is None:
        ref = out2                  # the primary declined: compare the peer with the second line
    del out2
    results.append(second)
    if fns is None:
        peer = {"impl": cfg.peer_label, "status": f"absent: {fns_error}"}
    else:
        peer = time_row(cfg, rep, cfg.peer_label, lambda: fla_call(fns, x, kind, decode), work=work, unit=unit,
                        ref_out=ref, deadline=deadline)
        peer.pop("_out", None)
    results.append(peer)
    del ref
    t_fla = peer.get("time_s")
    for r in results[:2]:
        if t_fla and r.get("time_s"):
            r["ratio_fla_over_this"] = t_fla / r["time_s"]
    for r in results:
        r["shape"] = shape
        r["kind"] = kind
    return results


def _rows_for_table(results, unit):
    rows = []
    for r in results:
        t = r.get("time_s")
        rows.append((
            r["shape"], r["kind"], r["impl"],
            f"{t * 1e3:.3f}" if t else "-",
            f"{r['rate']:.4g}" if t else "-",
            f"{r['ratio_fla_over_this']:.2f}" if r.get("ratio_fla_over_this") else "-",
            f"{r['diff_vs_ref']:.1e}" if r.get("diff_vs_ref") is not None else "-",
            f"{r['first_call_s']:.2f}" if r.get("first_call_s") is not None else "-",
            _short(r.get("status", ""), 90),
        ))
    return rows


def _load_fla(cfg):
    try:
        return fla_functions(cfg), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def section_prefill(cfg, rep):
    fns, err = _load_fla(cfg)
    K, V = cfg.K, cfg.V
    rep.print(f"inputs: q, k, v {str(cfg.dtype).replace('torch.', '')}, g / gk float32 in [-0.2, -0.001], "
              f"beta / erase / write uniform [0, 1], k L2-normalised, no initial state, final state returned")
    rep.print(f"TFLOP/s: {FLOP_FORMULA}; ratio = fla time / this time; diff = ||o - o_ref|| / ||o_ref|| with o_ref the first "
              f"deltarule line that ran; "
              f"1st s = the first call (compilation, autotuning) in seconds")
    results = []
    deadline = cfg.budget * PREFILL_SHARE
    for i, (name, Hk, Hv, T, seqs, kind) in enumerate(cfg.prefill):
        x = make_timing_inputs(cfg, Hk=Hk, Hv=Hv, T=T, seqs=seqs, kind=kind, seed=100 + i)
        tokens = x["q"].shape[1]
        results += run_group(cfg, rep, name, x, kind=kind, decode=False, work=flops(tokens, Hv, K, V),
                             unit="TFLOP/s", fns=fns, fns_error=err, deadline=deadline)
        del x
        free_memory(cfg)
    rep.table(("shape", "kind", "impl", "ms", "TFLOP/s", "ratio", "diff", "1st s", "status"),
              _rows_for_table(results, "TFLOP/s"))
    rep.data["prefill"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]


def section_decode(cfg, rep):
    fns, err = _load_fla(cfg)
    K, V = cfg.K, cfg.V
    rep.print(f"one token per sequence from a random fp32 state [N, Hv, K, V]; GB/s: {BYTES_FORMULA}")
    results = []
    for i, (Hk, Hv, N) in enumerate(cfg.decode):
        x = make_timing_inputs(cfg, Hk=Hk, Hv=Hv, N=N, kind="gdn", decode=True, seed=300 + i)
        results += run_group(cfg, rep, f"decode-v{Hv}-N{N}", x, kind="gdn", decode=True,
                             work=2 * N * Hv * K * V * 4, unit="GB/s", fns=fns, fns_error=err)
        for r in results[-3:]:
            r["N"], r["Hv"] = N, Hv
        del x
        free_memory(cfg)
    rep.table(("shape", "kind", "impl", "ms", "GB/s", "ratio", "diff", "1st s", "status"),
              _rows_for_table(results, "GB/s"))
    rep.data["decode"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]


GRAD_INPUTS = ("q", "k", "v", "g", "gk", "beta", "erase", "write")


def _grads(fn, x):
    """(o, the gradients of GRAD_INPUTS in x) of loss = (o * do).sum() + (state * dS).sum()."""
    leaves = [x[n] for n in GRAD_INPUTS if x.get(n) is not None]
    for t in leaves:
        t.requires_grad_(True)
    try:
        o, state = fn()
        gen = torch.Generator(device=o.device).manual_seed(0)
        loss = (o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() \
            + (state.float() * torch.randn(state.shape, generator=gen, device=o.device)).sum()
        return o, torch.autograd.grad(loss, leaves)
    finally:
        for t in leaves:
            t.requires_grad_(False)


def section_backward(cfg, rep):
    """Gradients of the primary backend: against the float64 reference's autograd on 130-token
    cases, then forward + backward time beside fla's chunk kernels (their own backward)."""
    label, backend = cfg.primary
    rep.print(f"loss = (o * do).sum() + (state * dS).sum(); grad diff = the largest ||d - d_ref|| / ||d_ref|| "
              f"over q, k, v and the gates; {label} = backend {backend!r}")
    rows, failed = [], 0
    for i, kind in enumerate(("gdn", "kda", "gdn2")):
        x = make_timing_inputs(cfg, Hk=2, Hv=4 if kind == "gdn" else 2, T=130, kind=kind, seed=500 + i)
        try:
            _, got = _grads(deltarule_call(x, backend), x)
            _, ref = _grads(deltarule_call(x, "reference"), x)
            err = max(_diff(a, b) for a, b in zip(got, ref))
            ok = err <= TOL[str(cfg.dtype).replace("torch.", "")] * 4
            status = "ok" if ok else "FAILED"
        except Exception as e:  # noqa: BLE001
            err, ok, status = float("nan"), False, f"ERROR {type(e).__name__}: {_short(str(e))}"
        failed += not ok
        rows.append((kind, "T130", f"{err:.1e}", status))
    rep.table(("kind", "shape", "grad diff", "status"), rows)
    fns, fns_error = _load_fla(cfg)
    timings = []
    for name, Hk, Hv, T, seqs, kind in [next(p for p in cfg.prefill if p[5] == k) for k in ("gdn", "kda", "gdn2")
                                         if any(p[5] == k for p in cfg.prefill)]:
        if cfg.elapsed() > cfg.budget:
            timings.append((name, kind, "-", "-", "-", "-", f"skipped: past the {cfg.budget:.0f} s budget"))
            continue
        x = make_timing_inputs(cfg, Hk=Hk, Hv=Hv, T=T, seqs=seqs, kind=kind, seed=600)
        row = [name, kind]
        try:
            ours = deltarule_call(x, backend)
            o_ref, g_ref = _grads(ours, x)
            t_ours = bench_s(cfg, lambda: _grads(ours, x))
            row += [f"{t_ours * 1e3:.2f}"]
            if fns is None:
                row += ["-", "-", "-", f"fla: {fns_error}"]
            else:
                theirs = fla_call(fns, x, kind, decode=False)
                _, g_fla = _grads(theirs, x)
                t_fla = bench_s(cfg, lambda: _grads(theirs, x))
                err = max(_diff(a, b) for a, b in zip(g_fla, g_ref))
                row += [f"{t_fla * 1e3:.2f}", f"{t_fla / t_ours:.2f}", f"{err:.1e}", "ok"]
        except Exception as e:  # noqa: BLE001
            row += ["-"] * (6 - len(row)) + [f"ERROR {type(e).__name__}: {_short(str(e))}"]
        timings.append(tuple(row[:7]))
        del x
        free_memory(cfg)
    rep.table(("shape", "kind", f"{label} fwd+bwd ms", "fla fwd+bwd ms", "ratio", "grad diff", "status"), timings)
    rep.print(f" {failed} failed")
    rep.data["backward"] = {"correctness": rows, "timings": timings, "failed": failed}


def section_transformers(cfg, rep):
    """`deltarule bench --model qwen3_5`'s model (float32) on the device: greedy tokens and prefill
    time with the linear layers on deltarule (`enable(cuda="deltarule")`: triton) and on fla
    (`enable(cuda="fla")`, where installed), beside transformers' own torch fallback."""
    import importlib.util

    import transformers

    import deltarule.integrations.transformers as dt
    from deltarule.tools.bench import model as bench_model

    sizes = dict(bench_model.MODELS["qwen3_5"]["kwargs"])
    if cfg.dry:
        sizes.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=2, head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**sizes)).to(cfg.device).eval()
    gen = torch.Generator().manual_seed(0)
    T = 128 if cfg.dry else 2048
    prefill = torch.randint(3, sizes["vocab_size"], (1, T), generator=gen).to(cfg.device)
    prompt = torch.randint(3, sizes["vocab_size"], (1, 64), generator=gen).to(cfg.device)

    def run():
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
            forward = lambda: model(prefill, use_cache=True, logits_to_keep=1)  # noqa: E731
            forward()
            return tokens, bench_s(cfg, forward)

    with dt.torch_fallback():
        ref_tokens, t_ref = run()
    rows = [("transformers fallback", "-", f"{t_ref * 1e3:.1f}", "1.00", "ok")]
    for mode in ("deltarule", "fla"):
        if mode == "fla" and (cfg.dry or importlib.util.find_spec("fla") is None):
            reason = "dry run: CPU tensors always run on deltarule" if cfg.dry else "fla not installed"
            rows.append((f'enable(cuda="{mode}")', "-", "-", "-", f"skipped: {reason}"))
            continue
        try:
            dt.enable(cuda=mode)
            tokens, t = run()
            same = torch.equal(tokens, ref_tokens)
            rows.append((f'enable(cuda="{mode}")', str(same), f"{t * 1e3:.1f}", f"{t_ref / t:.2f}",
                         "ok" if same else "FAILED"))
        except Exception as e:  # noqa: BLE001
            rows.append((f'enable(cuda="{mode}")', "-", "-", "-", f"ERROR {type(e).__name__}: {_short(str(e))}"))
        finally:
            dt.disable()
    rep.print(f"qwen3_5 ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, float32): greedy "
              f"64 + 16 tokens, prefill T = {T} (one forward with a cache)")
    rep.table(("linear layers on", "greedy tokens = fallback", "prefill ms", "speed-up", "status"), rows)
    rep.data["transformers"] = {"rows": rows}
    del model
    free_memory(cfg)


def section_targets(cfg, rep):
    label = cfg.primary[0]
    rows = []

    def add(target, shape, value, passed):
        rows.append((target, shape, value, "PASS" if passed else "MISS"))

    corr = rep.data.get("correctness")
    if corr is None:
        add("correctness within bounds", "-", "section did not finish", False)
    else:
        ran = len(corr["cases"]) - corr["declined"]
        add("correctness within bounds", f"{ran} runs", f"{corr['failed']} failed, {corr['declined']} declined/skipped, "
            f"poison active: {corr['poison_active']}", corr["failed"] == 0 and corr["poison_active"] and ran > 0)
    prefill = rep.data.get("prefill", [])
    for r in prefill:
        if r["impl"] != label or r["kind"] != "gdn" or not r["shape"].startswith("qwen"):
            continue
        ratio = r.get("ratio_fla_over_this")
        if ratio is None:
            add("prefill time <= fla's", r["shape"], _short(r.get("status", "no fla timing"), 60), False)
        else:
            add("prefill time <= fla's", r["shape"],
                f"deltarule/fla = {1 / ratio:.2f} (fla/deltarule {ratio:.2f})", 1 / ratio <= 1.0)
    bw = rep.data.get("hbm_copy_GBps")
    for r in rep.data.get("decode", []):
        if r["impl"] != label or r.get("N", 0) < cfg.decode_heavy:
            continue
        if bw is None or r.get("rate") is None:
            add("decode >= 80% of copy GB/s", r["shape"], _short(r.get("status", "no copy bandwidth"), 60), False)
        else:
            frac = r["rate"] / bw
            add("decode >= 80% of copy GB/s", r["shape"], f"{r['rate']:.0f} GB/s = {100 * frac:.0f}%", frac >= 0.8)
    fam = {}
    for r in prefill:
        if r["impl"] == label and r["shape"].startswith("mha"):
            fam[(r["shape"], r["kind"])] = r
    for (shape, kind), r in sorted(fam.items()):
        if kind == "gdn":
            continue
        base = fam.get((shape, "gdn"))
        if base is None or base.get("time_s") is None or r.get("time_s") is None:
            why = r.get("status") if r.get("time_s") is None else (base or {}).get("status", "no gdn timing")
            add(f"{kind} time <= 1.3x scalar GDN", shape, _short(why, 60), False)
        else:
            rel = r["time_s"] / base["time_s"]
            add(f"{kind} time <= 1.3x scalar GDN", shape, f"{rel:.2f}x", rel <= 1.3)
    rep.print(f"targets for deltarule {label!r} (issue: prefill <= fla on the Qwen3-Next shapes; decode >= 80% "
              f"of the measured copy bandwidth at N >= {cfg.decode_heavy}; KDA / GDN-2 within 1.3x of GDN)")
    rep.table(("target", "shape", "value", "verdict"), rows)
    passed = sum(r[3] == "PASS" for r in rows)
    rep.print(f"{passed} PASS, {len(rows) - passed} MISS")
    rep.data["targets"] = [dict(zip(("target", "shape", "value", "verdict"), r)) for r in rows]


# ---------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset for a first try (budget 150 s)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes, torch backend for triton and deltarule.contracts.fla for fla")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="also write gpu.json and gpu.md under this folder (default $OUT if set)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which remaining timings are skipped (default 360, quick 150, dry 60)")
    ap.add_argument("--sections", default=",".join(s.split()[0] for s in SECTIONS),
                    help="comma-separated subset of: environment,hbm,correctness,prefill,decode,backward,"
                         "transformers,targets")
    args = ap.parse_args(argv)
    cfg = Config(args)
    rep = Report()
    wanted = set(args.sections.split(","))
    mode = "dry run (CPU)" if cfg.dry else ("quick" if cfg.quick else "full")
    rep.print(f"deltarule GPU check, {mode}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    funcs = {"environment": section_environment, "hbm copy bandwidth": section_copy,
             "correctness": section_correctness, "prefill": section_prefill, "decode": section_decode,
             "backward": section_backward, "transformers": section_transformers, "targets": section_targets}
    errors = 0
    for title in SECTIONS:
        if title.split()[0] not in wanted:
            continue
        rep.header(title)
        t0 = time.perf_counter()
        try:
            funcs[title](cfg, rep)
        except Exception as e:  # noqa: BLE001
            errors += 1
            rep.print(f"section failed: {type(e).__name__}: {e}")
            for line in traceback.format_exc().rstrip().splitlines()[-8:]:
                rep.print("  " + line)
        rep.data["sections"][title] = round(time.perf_counter() - t0, 2)
        rep.print(f"({title}: {time.perf_counter() - t0:.1f} s, total {cfg.elapsed():.1f} s)")
        if args.out:
            _write(rep, args.out, quiet=True)   # after every section: a run killed later keeps its tables
    rep.print("")
    rep.print(f"done in {cfg.elapsed():.1f} s; {errors} section(s) failed")
    if args.out:
        _write(rep, args.out, quiet=False)
    return 1 if errors else 0


def _write(rep, out, quiet):
    try:
        rep.write(out)
        if not quiet:
            print(f"wrote {os.path.join(out, 'gpu.json')} and {os.path.join(out, 'gpu.md')}", flush=True)
    except OSError as e:
        print(f"could not write to {out}: {e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
