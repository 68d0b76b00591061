"""`deltarule bench`: time bench.json cases beside the peers installed here.

Each selected case is built once by `deltarule.cases.make_inputs`; deltarule
(`linear_attention(**inputs, backend=...)`) and every peer that can express
the case run on those same inputs (a slab case: each from a copy of the same
slab): untimed warm-up calls, then timed samples within a time budget
(`timing.measure`), reporting the median. Each peer's first output and final
state are checked against deltarule's outside the timing, so a ratio is only
printed beside a statement of whether both computed the same thing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import math
import os
import statistics
import sys
from importlib import metadata

import torch

from ... import ContractError, Unsupported, __version__, arguments, linear_attention, plan_batch
from ...backends import cpu_backend
from ...backends import names as backend_names
from ...cases import DTYPES, bench_cases, make_inputs
from ..check import STORE_TOL
from . import compact, report
from .load import busy
from .model import MODELS
from .peers import PEERS, Skip
from .timing import BATCH_SECONDS, LOADED_BATCH_SECONDS, PAUSE_SECONDS, WARMUP_SECONDS, interleaved, measure, paired

# --cold: at most this many copies of a case's inputs.
MAX_INPUT_COPIES = 64
LAST_LEVEL_CACHE_BYTES = cpu_backend.LAST_LEVEL_CACHE_BYTES     # sysfs; 32 MiB where unknown
# Relative error ||peer - deltarule|| / ||deltarule|| above which a peer is
# flagged as computing something else (outputs and final state); a 16-bit state
# adds its one rounding (`check.STORE_TOL`).
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `deltarule bench`."""
    parser.add_argument("--case", action="append", metavar="NAME",
                        help="a case name, or a substring of names (repeatable); default: every "
                             "case except the tiny smoke cases")
    parser.add_argument("--backend", default="auto", choices=("auto", *backend_names()),
                        help="deltarule backend (default auto)")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                        help="q, k, v and gate dtype (default float32; the state is float32)")
    parser.add_argument("--quick", action="store_true",
                        help="only the cases marked quick (a few minutes on 2 cores)")
    parser.add_argument("--repeat", type=_positive(int), default=5, metavar="N",
                        help="at most N timed samples per implementation and case (default 5; a sample "
                             "of a short call is the mean of a batch lasting >= 2 ms)")
    parser.add_argument("--budget", type=_positive(float), default=2.0, metavar="SECONDS",
                        help="stop repeating once this much time is spent (default 2; "
                             "at least one timed call always runs)")
    parser.add_argument("--cold", action="store_true",
                        help="decode / verify cases read their states from memory, as a model's layers do "
                             "when their states outgrow the cache: every implementation cycles through "
                             "copies of the inputs filling twice the last-level cache (default: the same "
                             "inputs every call, cache-resident where they fit)")
    parser.add_argument("--backward", action="store_true",
                        help="forward + backward of the prefill cases beside autograd through the peers' "
                             "torch functions, and the memory the forward keeps for the backward")
    parser.add_argument("--model", metavar="FAMILY", choices=sorted(MODELS),
                        help="a transformers hybrid model of realistic layer sizes (random weights) end to end: "
                             "prefill and greedy-decode tokens/s on transformers' fallback and on deltarule, "
                             "and the share of time in the linear-attention layers (one of: %(choices)s)")
    parser.add_argument("--load", type=_at_least_zero, default=0, metavar="N",
                        help="run N processes that spin on the CPU for the whole run, as other jobs on a "
                             "shared machine do (default 0; the report says how many ran)")
    parser.add_argument("--plot", metavar="FILE.png", help="save a bar chart of the times")
    parser.add_argument("--json", metavar="FILE", help="write machine-readable results")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write the JSON and plot if asked.

    The options are checked before anything runs (`check_options`): a bad --case or an
    output path that cannot be written raises `ContractError` (the CLI prints it as one
    line, exit status 2) instead of failing after the run.
    """
    cases = check_options(args)
    with busy(args.load):
        return _run(args, cases)


def _run(args: argparse.Namespace, cases: list[dict] | None) -> int:
    if args.model:
        from . import model

        meta = _meta(args)
        result = model.run(args)        # Unsupported where the family is not bound: nothing to compare
        print(model.table(result, meta))
        _write_json(args.json, {"meta": meta, "model": result})
        return 0
    if args.backward:
        from . import backward

        meta = _meta(args)
        results = backward.run(cases, args)
        print(backward.table(results, meta))
        _write_json(args.json, {"meta": meta, "backward": results})
        return 0
    peer_names = [p.name for p in PEERS]
    meta = _meta(args)
    meta["copy_gb_per_s"] = copy_bandwidth()
    stalls = _cpu_stalls()
    results = run(cases, args)
    if stalls is not None:
        meta["cpu_kernel_stalls"] = _cpu_stalls() - stalls
    print(report.table(results, meta, peer_names))
    _write_json(args.json, {"meta": meta, "results": results})
    if args.plot:
        from .plot import plot

        title = f"deltarule bench ({meta['dtype']}, torch {meta['torch']}, {meta['threads']} threads)"
        try:
            plot(results, peer_names, args.plot, title)
        except OSError as e:            # checked up front; still possible (a full disk)
            raise ContractError("--plot", "a writable file path", f"{args.plot!r} ({_one_line(e)})") from e
    return 0


def check_options(args: argparse.Namespace) -> list[dict] | None:
    """What `main` checks before running anything; the selected cases (None with --model).

    Raises `ContractError` naming the option: --case selecting nothing (--backward: no
    prefill case), --json / --plot not a writable file path (`deltarule.tools.paths.writable_file`),
    --plot with --model or --backward (only the case table is plotted); `Unsupported`:
    --plot without matplotlib.
    """
    from ..paths import writable_file

    if args.json is not None:
        writable_file("--json", args.json)
    if args.plot is not None:
        if args.model or args.backward:
            raise ContractError("--plot", "the case table's run (there is no chart of --model or --backward)",
                                f"--plot with --{'model' if args.model else 'backward'}")
        writable_file("--plot", args.plot)
        if importlib.util.find_spec("matplotlib") is None:
            raise Unsupported("--plot needs matplotlib, which is not installed: pip install matplotlib")
        if args.json is not None and os.path.abspath(args.json) == os.path.abspath(args.plot):
            raise ContractError("--plot", "a file other than --json's", repr(args.plot))
    if args.model:
        return None
    cases = select_cases(bench_cases(), args.case, args.quick)
    if args.backward and not any(c["kind"] == "prefill" for c in cases):
        raise ContractError("--backward", "a selection with a prefill case (--backward times prefill only)",
                            f"{len(cases)} decode / verify case{'s' * (len(cases) != 1)}")
    return cases


def _write_json(path: str | None, data: dict) -> None:
    if path:
        text = json.dumps(data, indent=2) + "\n"         # a bug in the data fails before the file is touched
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:            # checked up front; still possible (a full disk)
            raise ContractError("--json", "a writable file path", f"{path!r} ({_one_line(e)})") from e


def select_cases(cases: list[dict], patterns: list[str] | None, quick: bool) -> list[dict]:
    """The cases to run, in file order.

    A pattern selects the case of that exact name, else every case whose
    name contains it; each pattern must select something. Without patterns,
    every case but the smoke cases. `quick` keeps the cases marked quick.
    Raises `ContractError` (a ValueError) naming --case where a pattern or the
    whole selection selects nothing.
    """
    if patterns:
        chosen = set()
        for pattern in patterns:
            exact = [c["name"] for c in cases if c["name"] == pattern]
            found = exact or [c["name"] for c in cases if pattern in c["name"]]
            if not found:
                raise ContractError("--case", "a bench.json case name or a substring of names",
                                    f"{pattern!r}: no bench case matches it")
            chosen.update(found)
        selected = [c for c in cases if c["name"] in chosen]
    else:
        selected = [c for c in cases if not c.get("smoke", False)]
    if quick:
        selected = [c for c in selected if c.get("quick", False)]
    if not selected:
        raise ContractError("--case", "a selection of at least one case",
                            "no bench case selected" + (" (--quick keeps the cases marked quick only)" * quick))
    return selected


def run(cases: list[dict], args: argparse.Namespace) -> list[dict]:
    """Time every case; one result dict per case (see `run_case`)."""
    absent = {p.name: p.absent() for p in PEERS}
    progress = _Progress(len(cases))
    try:
        results = []
        for case in cases:
            results.append(run_case(case, args, absent, progress))
            progress.advance()
            gc.collect()
        return results
    finally:
        progress.close()


def run_case(case: dict, args: argparse.Namespace, absent: dict, progress: "_Progress") -> dict:
    """{"case": case, "deltarule": entry, "peers": {name: entry}} for one case.

    deltarule and every peer that can run the case are timed together (`timing.interleaved`).
    An entry has "status" ("ok", "skipped" or "error"); an "ok" entry has median_ms, min_ms and
    samples_ms (one per round); deltarule's also tokens_per_s, gflop_per_s and gb_per_s and, for
    decode / verify, "plan" (the same call with a plan built once: `_deltarule_calls`) and, where
    the cpu backend runs it, kernel_ms, paired_plan_ms and overhead_us (the plan call and its
    kernel alone alternated call by call, `timing.paired`: their medians and that of their
    difference); a peer's
    ratio (its time / deltarule's serving time, the median over rounds), ratio_range (min, max
    over rounds), rel_err, match and note; the others have a one-line "reason".
    """
    copies = _input_copies(case, make_inputs(case, args.dtype), args.cold)
    if "state_indices" in copies[0]:     # deltarule's timed calls update the slab: the peers start from a copy
        peer_copies = [_clone(c) for c in copies]
    else:
        peer_copies = copies
    progress.show(f"{case['name']}: deltarule")
    try:
        mine, reference = _deltarule_calls(case, copies, args)
    except (ContractError, Unsupported, RuntimeError, MemoryError) as e:
        reason = "deltarule did not run, nothing to compare"
        return {"case": case, "deltarule": {"status": "error", "reason": _one_line(e)},
                "peers": {p.name: _skipped(absent[p.name] or reason) for p in PEERS}, "input_copies": len(copies)}
    peers, runs = {}, {}
    for peer in PEERS:
        progress.show(f"{case['name']}: {peer.name}")
        if absent[peer.name]:
            peers[peer.name] = _skipped(absent[peer.name])
            continue
        checked = _check_peer(peer, case, peer_copies, reference, args)
        if isinstance(checked, dict):
            peers[peer.name] = checked
        else:
            runs[peer.name], peers[peer.name] = checked
    kernel = mine.pop("kernel", None)
    progress.show(f"{case['name']}: timing {len(mine) + len(runs)} implementations, interleaved")
    timings = interleaved({**mine, **runs}, args.repeat, args.budget, _batch_seconds(args))
    serving = timings.get("plan", timings["call"])
    entry = _times(timings["call"])
    entry.update(report.throughput(case, serving.median))
    if "plan" in timings:
        entry["plan"] = _times(timings["plan"])
    if kernel is not None:
        progress.show(f"{case['name']}: deltarule's call with a plan and its kernel alone, alternated")
        pair = paired(mine["plan"], kernel, args.budget)
        entry.update(kernel_ms=pair.b * 1e3, paired_plan_ms=pair.a * 1e3, overhead_us=pair.difference * 1e6)
    for name in runs:
        ratios = timings[name].ratios(serving)
        peers[name].update(_times(timings[name]), ratio=statistics.median(ratios),
                           ratio_range=(min(ratios), max(ratios)))
    if "compact" in timings:
        entry["compact"] = _compact_entry(case, copies[0], timings, list(runs))
    return {"case": case, "deltarule": entry, "peers": peers, "input_copies": len(copies)}


def _compact_entry(case: dict, inputs: dict, timings: dict, peers: list[str]) -> dict:
    """The compact verify step's times, and every other implementation's time over its time
    per round (median, [min, max]: > 1 means verify + replay is faster), with the state bytes
    a request keeps per layer (per-token rows, one row + the capture buffer)."""
    mine = timings["compact"]
    versus = {}
    for name in ("plan", *peers):
        ratios = timings[name].ratios(mine)
        versus[name] = (statistics.median(ratios), min(ratios), max(ratios))
    rows_bytes, compact_bytes = compact.state_bytes(case, inputs)
    return {**_times(mine), "versus": versus, "per_token_bytes": rows_bytes, "compact_bytes": compact_bytes}


def _input_copies(case: dict, inputs: dict, cold: bool) -> list[dict]:
    """[inputs], or with `cold` (decode / verify cases) as many equal copies as make the calls'
    states fill twice the last-level cache: cycling through them, every call reads its states
    from memory."""
    if not cold or case["kind"] not in ("decode", "verify"):
        return [inputs]
    n = min(MAX_INPUT_COPIES, math.ceil(2 * LAST_LEVEL_CACHE_BYTES / report.state_bytes(case)))
    return [inputs] + [_clone(inputs) for _ in range(n - 1)]


def _clone(inputs: dict) -> dict:
    return {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}


def _deltarule_calls(case: dict, copies: list[dict], args) -> tuple[dict, tuple]:
    """The deltarule calls to time, by name, and the (output, state) the peers are checked
    against (of a slab call: the rows it wrote, computed on a copy of the slab, which the timed
    calls keep updating). Each callable cycles through the copies of the inputs.

    "call": the case's arguments as a caller without a plan passes them. Decode / verify also
    time "plan": the same call with a plan built once outside the timing for every copy (as a
    decode step's layers share one), checked against "call"; and, where the cpu backend runs it,
    "kernel": that call's kernel launch alone (`cpu_backend.Launch.kernel`): the call's time
    minus the kernel's is its overhead."""
    inputs = copies[0]
    if "state_indices" in inputs:
        o, slab = linear_attention(**dict(inputs, initial_state=inputs["initial_state"].clone()),
                                   backend=args.backend)
        reference = (o, slab[inputs["state_indices"].reshape(-1)])
    else:
        reference = linear_attention(**inputs, backend=args.backend)
    plain = itertools.cycle(copies)
    calls = {"call": lambda: linear_attention(**next(plain), backend=args.backend)}
    if case["kind"] not in ("decode", "verify"):
        return calls, reference
    layout = {n: inputs[n] for n in ("cu_seqlens", "seq_lens", "state_indices", "num_accepted_tokens")
              if n in inputs}
    slots = inputs["initial_state"].shape[0] if "state_indices" in layout else None
    plan = plan_batch(*inputs["q"].shape[:2], **layout, num_slots=slots)
    planned = [{**{n: x for n, x in c.items() if n not in layout}, "plan": plan} for c in copies]
    check = dict(planned[0], initial_state=inputs["initial_state"].clone())
    o, state = linear_attention(**check, backend=args.backend)
    got = (o, state[inputs["state_indices"].reshape(-1)]) if "state_indices" in layout else (o, state)
    if rel_error(got, reference) > STORE_TOL[state.dtype]:
        raise RuntimeError(f"the call with a plan differs from the call without: {rel_error(got, reference):.1e}")
    cycle = itertools.cycle(planned)
    calls["plan"] = lambda: linear_attention(**next(cycle), backend=args.backend)
    if case["kind"] == "verify" and "num_accepted_tokens" in inputs:
        diff = compact.check(inputs, args.backend)
        if diff > STORE_TOL[state.dtype] + 1e-4:
            raise RuntimeError(f"verify + replay (compact capture) differs from the per-token rows: {diff:.1e}")
        calls["compact"] = compact.calls(copies, args.backend)
    launches = [_launch(c, args.backend) for c in planned]
    if all(launch is not None for launch in launches):
        kernels = itertools.cycle([launch.kernel(*(c.get(n) for n in _LAUNCH_INPUTS))
                                   for launch, c in zip(launches, planned)])
        calls["kernel"] = lambda: next(kernels)()
    return calls, reference


_LAUNCH_INPUTS = arguments.LAUNCH_OPERANDS      # a kept launch's tensor arguments, in its order


def _launch(call: dict, backend: str):
    """The cpu backend's kernel launch of a call with a plan (None where it keeps none)."""
    from ... import api
    from ...backends import launch

    if any(not call[n].is_contiguous() for n in _LAUNCH_INPUTS[:-1] if call.get(n) is not None):
        return None
    return launch(api.validate(**call), backend)


def _check_peer(peer, case: dict, copies: list[dict], reference: tuple, args):
    """A peer's entry (skipped, failed, or a mismatch / match from its first call) and the
    callable to time (cycling through its copies of the inputs, as deltarule's calls do); or
    just the entry where it cannot run."""
    inputs = copies[0]
    try:
        prepared = [peer.prepare(case, c) for c in copies]
    except Skip as e:
        return _skipped(str(e))
    try:
        got = prepared[0].unpack(prepared[0].run())
    except Exception as e:  # a peer's failure is reported, not fatal
        return {"status": "error", "reason": _one_line(e)}
    shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in zip(got, reference)]
    if any(a != b for a, b in shapes):
        return {"status": "error", "reason": f"shapes (output, state) {shapes[0][0]}, {shapes[1][0]} "
                                             f"!= deltarule's {shapes[0][1]}, {shapes[1][1]}"}
    err = rel_error(got, reference)
    state = inputs.get("initial_state")
    tol = TOLERANCE[args.dtype] + STORE_TOL[torch.float32 if state is None else state.dtype]
    cycle = itertools.cycle(prepared)
    entry = {"status": "ok", "rel_err": err if math.isfinite(err) else None, "match": err <= tol,
             "note": prepared[0].note}
    return (lambda: next(cycle).run()), entry


def copy_bandwidth(mib: int = 256, repeat: int = 5) -> float:
    """GB/s of torch's copy_ between two float32 tensors of `mib` MiB (bytes read +
    written), median of `repeat`: the memory ceiling that decode is compared with."""
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), repeat, budget=5.0)
    return 2 * src.numel() * 4 / timing.median / 1e9


def rel_error(got: tuple, want: tuple) -> float:
    """max over same-shaped (output, state) of ||got - want|| / ||want||, in float64.

    NaN or infinity anywhere gives a non-finite result.
    """
    errors = [((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
              for a, b in zip(got, want)]
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _times(timing) -> dict:
    return {"status": "ok", "median_ms": timing.median * 1e3, "min_ms": min(timing.samples) * 1e3,
            "max_ms": max(timing.samples) * 1e3, "samples_ms": [s * 1e3 for s in timing.samples]}


def _skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _meta(args) -> dict:
    return {
        "deltarule": __version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "load_avg_at_start": _load_average(), "busy_processes": args.load,
        "dtype": args.dtype, "backend": args.backend, "cold": args.cold,
        "last_level_cache_bytes": LAST_LEVEL_CACHE_BYTES,
        "peers": {n: _version(n) for n in ("transformers", "onnxruntime")},
        "legends": [p.legend for p in PEERS],
        "flop_model": report.FLOP_MODEL, "bytes_model": report.BYTES_MODEL,
        "ratio": report.RATIO_NOTE,
        "timing": report.timing_note(PAUSE_SECONDS, WARMUP_SECONDS, _batch_seconds(args)),
    }


def _batch_seconds(args: argparse.Namespace) -> float:
    """A sample's least length: longer on a machine --load makes busy (timing.LOADED_BATCH_SECONDS)."""
    return LOADED_BATCH_SECONDS if args.load else BATCH_SECONDS


def _cpu_stalls() -> int | None:
    """The cpu kernels' stalls so far (csrc/team.h: parallel calls that waited for a helper the
    scheduler had not run), or None without the native kernel."""
    from ...kernels.cpu import recurrent as cpu_recurrent

    return cpu_recurrent.contention().stalls if cpu_recurrent.available() else None


def _load_average() -> float | None:
    """The 1-minute load average: other work on the machine skews the times."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0: {text}")
    return value


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value <= 0:      # nan passes `<= 0`; nan, inf: no budget at all
            raise argparse.ArgumentTypeError(f"must be a finite number > 0: {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


class _Progress:
    """A tqdm bar over cases on stderr, or plain progress lines without tqdm."""

    def __init__(self, total: int):
        self._total, self._done = total, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, unit="case", file=sys.stderr, leave=False, dynamic_ncols=True)

    def show(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text)
        else:
            print(f"[{self._done + 1}/{self._total}] {text}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
