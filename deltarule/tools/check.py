"""`deltarule check`: every test.json case on a backend against the float64 reference.

`compare` is the one comparison used by the CLI and the test-suite: relative
error ||out - ref|| / ||ref|| of the output and of the returned state (the
whole slab for slab cases, so untouched rows must come back bit-identical
enough to vanish from the error), NaN counting as a failure.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import api, reference
from ..backends import REGISTRY
from ..backends import names as backend_names
from ..cases import DTYPES, make_inputs, test_cases
from ..errors import ContractError, Unsupported


# The relative error one rounding of the returned state to a 16-bit storage dtype adds,
# above the tolerance of the case's inputs: at most half an ulp per element
# (bfloat16 2^-9, float16 2^-12, relative), with a 2x margin; float32 adds nothing.
STORE_TOL = {torch.float32: 0.0, torch.bfloat16: 2 * 2.0 ** -9, torch.float16: 2 * 2.0 ** -12}


@dataclass
class Result:
    case: str
    dtype: str
    backend: str
    err_o: float
    err_state: float
    tol: float
    tol_state: float
    seconds: float
    err_capture: float = 0.0       # the capture buffer's (a case with `capture`), against o's tolerance

    @property
    def passed(self) -> bool:
        return self.err_o <= self.tol and self.err_state <= self.tol_state and self.err_capture <= self.tol


def rel_err(out: torch.Tensor, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf; a zero ref needs a zero out."""
    out64 = out.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(out64).all():
        return float("inf")
    num = float(np.linalg.norm(out64 - ref))
    den = float(np.linalg.norm(ref))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def expected(args: dict) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference output and returned state for a call's arguments.

    For slab calls the expected state is the whole slab: untouched rows as
    they were, the final and per-token rows replaced by the sequences' states.
    """
    return expected_with_capture(args)[:2]


def expected_with_capture(args: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`expected` and the capture buffer the call leaves (None without `capture`; NaN where
    the call writes nothing)."""
    backend_free = {n: x for n, x in args.items() if n != "backend"}
    p = api.validate(**backend_free, accept_growth=True)      # the oracle computes any log decay
    sol = reference.solve(p)
    capture = None if sol.capture is None else reference.expected_capture(p, sol.capture)
    return sol.o, reference.expected_state(p, sol).numpy(), capture


def capture_err(out: torch.Tensor, ref: np.ndarray) -> float:
    """`rel_err` of a capture buffer over the entries the reference wrote; inf unless the
    backend wrote exactly those (NaN-poisoned buffers: an entry written past a sequence's
    count, or one left unwritten, shows)."""
    out64 = out.detach().to("cpu", torch.float64).numpy()
    written = ~np.isnan(ref)
    if not np.array_equal(~np.isnan(out64), written):
        return float("inf")
    return rel_err(torch.from_numpy(out64[written]), ref[written])


@functools.lru_cache(maxsize=None)
def expected_for_case(name: str, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`expected` of a test.json case, computed once per process."""
    case = next(c for c in test_cases() if c["name"] == name)
    return expected_with_capture(make_inputs(case, dtype))


def compare(case: dict, dtype: str, backend: str, device: str = "cpu") -> Result:
    args = make_inputs(case, dtype, device)
    ref_o, ref_state, ref_capture = expected_for_case(case["name"], dtype)
    start = time.perf_counter()
    o, state = api.linear_attention(**args, backend=backend)
    seconds = time.perf_counter() - start
    if o.dtype != args["v"].dtype:
        raise AssertionError(f"{case['name']}: output dtype {o.dtype}, expected v's {args['v'].dtype}")
    if args.get("state_indices") is not None and state is not args["initial_state"]:
        raise AssertionError(f"{case['name']}: a slab call must return the slab itself")
    init = args.get("initial_state")
    state_dtype = init.dtype if init is not None else torch.float32
    if state.dtype != state_dtype:
        raise AssertionError(f"{case['name']}: state dtype {state.dtype}, expected {state_dtype}")
    tol = float(case["tol"][dtype])
    err_capture = 0.0 if ref_capture is None else capture_err(args["capture"], ref_capture)
    return Result(case["name"], dtype, backend, rel_err(o, ref_o), rel_err(state, ref_state), tol,
                  tol + STORE_TOL[state_dtype], seconds, err_capture)


def _device(text: str) -> str:
    """--device: cpu, or a CUDA device that exists here (argparse reports anything else,
    exit status 2, instead of a traceback from the first tensor made there)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (cpu or cuda[:N])") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the cases run on cpu or cuda[:N]")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"no CUDA device {text!r} on this machine "
                                         f"(torch {torch.__version__} sees {torch.cuda.device_count()})")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="torch", choices=("auto", *backend_names()),
                        help="backend to check (default torch)")
    parser.add_argument("--dtype", choices=[*DTYPES, "all"], default="all",
                        help="input dtype (default: every dtype each case lists)")
    parser.add_argument("--case", action="append", default=None,
                        help="only cases whose name contains this (repeatable)")
    parser.add_argument("--device", default="cpu", type=_device,
                        help="where the inputs are made: cpu (default) or cuda[:N]")
    parser.add_argument("--peers", action="store_true",
                        help="also compare the contract adapters with ONNX Runtime, ONNX's reference "
                             "evaluator and flash-linear-attention (skipped where not installed)")


def main(args: argparse.Namespace) -> int:
    """Run the selected cases; 0 only when something ran and nothing failed.

    A check that ran nothing (no case selected, the backend unavailable here, or every call
    declined) exits non-zero with a line saying why: it must not read as a pass. A --case or
    --dtype that selects nothing raises `ContractError` (the CLI: one line, exit status 2).
    """
    named = [case for case in test_cases() if not args.case or any(s in case["name"] for s in args.case)]
    if not named:
        raise ContractError("--case", "a substring of a test.json case name",
                            f"{' '.join(f'--case {s!r}' for s in args.case)} (no test.json case matches)")
    selected = [(case, dtype) for case in named for dtype in case["dtypes"] if args.dtype in ("all", dtype)]
    if not selected:
        listed = sorted({dtype for case in named for dtype in case["dtypes"]})
        raise ContractError("--dtype", f"one the selected cases list ({', '.join(listed)}) or all",
                            f"{args.dtype!r} (no test.json case matches --dtype {args.dtype})")
    if args.backend != "auto" and (why := REGISTRY[args.backend].unavailable()) is not None:
        print(f"deltarule check: backend {args.backend!r} is not available on this machine: {why}",
              file=sys.stderr)
        return 1
    results, declined = [], 0
    print(f"{'case':<44} {'dtype':<9} {'err(o)':>9} {'err(S)':>9} {'tol(o)':>8} {'tol(S)':>8}  result")
    for case, dtype in selected:
        try:
            r = compare(case, dtype, args.backend, args.device)
        except Unsupported as e:        # a backend may decline a valid call; it is not a pass
            declined += 1
            print(f"{case['name']:<44} {dtype:<9} {'':>9} {'':>9} {'':>8} {'':>8}  declined: {e}", flush=True)
            continue
        results.append(r)
        verdict = "pass" if r.passed else "FAIL"
        print(f"{r.case:<44} {r.dtype:<9} {r.err_o:9.2e} {r.err_state:9.2e} {r.tol:8.0e} {r.tol_state:8.1e}"
              f"  {verdict}", flush=True)
    failed = sum(not r.passed for r in results)
    print(f"backend {args.backend}: {len(results) - failed} passed, {failed} failed, {declined} declined")
    if not results:
        print(f"deltarule check: nothing was checked: backend {args.backend!r} declined all {declined} "
              "selected calls (the reasons are in the table)", file=sys.stderr)
    if args.peers:
        failed += _check_peers()
    return 1 if failed or not results else 0


def _check_peers() -> int:
    from .oracles import run_checks

    print(f"\n{'contract adapter vs its runtime':<68} {'max err':>9} {'tol':>8}  result")
    failed = 0
    for r in run_checks():
        if r.skipped:
            print(f"{r.name:<68} {'':>9} {r.tol:8.0e}  skipped: {r.skipped}")
            continue
        failed += not r.passed
        print(f"{r.name:<68} {max(r.errors.values()):9.2e} {r.tol:8.0e}  {'pass' if r.passed else 'FAIL'}")
    return failed
