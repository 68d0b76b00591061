"""Work models (FLOPs, state bytes) and the printed results table."""

from __future__ import annotations

FLOP_MODEL = (
    "GFLOP/s counts per token per state head: prefill, the chunked model "
    "6*K*V + C*(5K+3V) + C^2/3 (C = chunk_size; ~165 kFLOP at K=V=128, C=64); "
    "decode and verify, the recurrent model 7*K*V (docs/algorithm.md, section 6)"
)
BYTES_MODEL = ("GB/s (decode, verify): state bytes read + written, (1 + stores)*N*Hv*K*V*e per call "
               "(one read per sequence; stores = 1 for decode, T for verify; e = 4, or 2 for a 16-bit state); "
               "copy: that as a share of the copy bandwidth measured at the start of the run")
RATIO_NOTE = ("ratio = peer time / deltarule time (decode / verify: its call with a plan), the median of the "
              "ratios of the rounds, [min-max] over rounds: >1 means deltarule is faster")
SERVING_NOTE = ("decode / verify: 'deltarule ms' is a call without a plan (its indices read to find the plan "
                "kept for them), 'plan ms' the same call with a plan built once; 'kernel ms' is that call's C "
                "kernel alone (no Python but packing its operands' addresses) and 'overhead us' the median of "
                "(plan call - kernel) over pairs of the two alternated call by call (the same caches and "
                "threads for both); '+-' is half the spread (max - min) of 'deltarule ms' over rounds, as a "
                "share of its median")


def timing_note(pause: float, warmup: float, batch: float) -> str:
    """How `deltarule bench` times (`timing.interleaved`), for the table's header."""
    return (f"times: every implementation of a case (deltarule's calls and each peer) warmed up for {warmup:g} s, "
            f"then timed in rounds, one batch of calls (>= {batch * 1e3:g} ms) each per round, in an order "
            f"rotated round to round, after a {pause * 1e3:g} ms pause (threads that spin after a call, ONNX "
            f"Runtime's and OpenMP's, go idle); the median over rounds")


def flops(case: dict) -> float:
    """FLOPs of one call under the model quoted in FLOP_MODEL."""
    K, V = case["K"], case["V"]
    if case["kind"] in ("decode", "verify"):
        per_token = 7 * K * V
    else:
        C = case.get("chunk_size", 64)
        per_token = 6 * K * V + C * (5 * K + 3 * V) + C * C / 3
    return case["B"] * case["T"] * case["Hv"] * per_token


def state_bytes(case: dict) -> float:
    """Bytes of state read and written by one decode or verify call: each sequence's state
    read once, then stored once (decode) or after each of its T tokens (verify)."""
    element = 2 if case.get("state_dtype") in ("bfloat16", "float16") else 4
    stores = case["T"] if case["kind"] == "verify" else 1
    return (1 + stores) * case["B"] * case["Hv"] * case["K"] * case["V"] * element


def throughput(case: dict, seconds: float) -> dict:
    """tokens/s, GFLOP/s and (decode, verify) GB/s at a given time per call."""
    memory_bound = case["kind"] in ("decode", "verify")
    return {
        "tokens_per_s": case["B"] * case["T"] / seconds,
        "gflop_per_s": flops(case) / seconds / 1e9,
        "gb_per_s": state_bytes(case) / seconds / 1e9 if memory_bound else None,
    }


def table(results: list[dict], meta: dict, peers: list[str]) -> str:
    """The results table with its header and footer, as one string."""
    notes = _Footnotes()
    header = ["case", "kind", "BxT", "Hq/Hk/Hv", "deltarule ms", "+-", "plan ms", "kernel ms", "overhead us",
              "tok/s", "GFLOP/s", "GB/s", "copy"]
    for name in peers:
        header += [f"{name} ms", "ratio", "[min-max]"]
    header.append("check")
    rows = [_row(r, peers, notes, meta.get("copy_gb_per_s")) for r in results]
    lines = [
        f"deltarule {meta['deltarule']} bench: torch {meta['torch']}, {meta['threads']} threads, "
        f"dtype {meta['dtype']}, backend {meta['backend']}, "
        + ", ".join(f"{n} {v}" for n, v in meta["peers"].items()),
        meta["timing"],
        RATIO_NOTE,
        SERVING_NOTE,
        _cache_line(meta),
        _load_line(meta),
        _copy_line(meta),
        "",
        *align([header, *rows]),
        *_compact_lines(results),
        "",
        FLOP_MODEL,
        BYTES_MODEL,
        *meta["legends"],
        *notes.lines(),
    ]
    return "\n".join(lines)


def _compact_lines(results: list[dict]) -> list[str]:
    """The verify cases' compact step (capture + replay) beside their per-token rows and peers."""
    rows = [["verify case", "per-token rows (plan) ms", "capture + replay ms", "vs per-token", "[min-max]",
             "peers (their time / capture + replay)", "state / request / layer: rows vs row + capture"]]
    for r in results:
        c = r["deltarule"].get("compact")
        if c is None:
            continue
        ratio, low, high = c["versus"]["plan"]
        peers = ", ".join(f"{n} {m:.3g}x [{lo:.3g}-{hi:.3g}]" for n, (m, lo, hi) in c["versus"].items() if n != "plan")
        rows.append([r["case"]["name"], _ms(r["deltarule"]["plan"]["median_ms"]), _ms(c["median_ms"]),
                     f"{ratio:.3g}x", f"[{low:.3g}-{high:.3g}]", peers or "-",
                     f"{c['per_token_bytes'] / 2**20:.3g} MiB vs {c['compact_bytes'] / 2**20:.3g} MiB"])
    if len(rows) == 1:
        return []
    return ["", "Speculative verify with compact capture (linear_attention(capture=) + deltarule.replay of the "
            "accepted count, one row per request) against the same step with a row per token; ratio = the "
            "other's time / capture + replay's, > 1: capture + replay is faster", *align(rows)]


def _cache_line(meta: dict) -> str:
    llc = meta.get("last_level_cache_bytes", 0) / 2**20
    if meta.get("cold"):
        return (f"--cold: decode / verify calls cycle through copies of their inputs filling twice the "
                f"{llc:.0f} MiB last-level cache (states read from memory)")
    return (f"every call reads the same inputs: decode / verify states under the {llc:.0f} MiB last-level "
            f"cache stay there (--cold reads them from memory)")


def _load_line(meta: dict) -> str:
    load = meta["load_avg_at_start"]
    text = f"load average {load:.2f} at start" if load is not None else "load average unknown"
    busy = meta.get("busy_processes", 0)
    spinning = f"; --load: {busy} process{'es' * (busy != 1)} spinning for the whole run" if busy else ""
    stalls = meta.get("cpu_kernel_stalls")
    seen = "" if stalls is None else (f"; the cpu kernels saw {stalls} stall{'s' * (stalls != 1)} (a call waiting "
                                      f"for a helper the scheduler had not run: small calls then ran alone a while)")
    return f"{text} on {meta['cpus']} CPUs{spinning}{seen} (other busy processes slow the torch paths most)"


def _copy_line(meta: dict) -> str:
    copy = meta.get("copy_gb_per_s")
    if copy is None:
        return "copy bandwidth not measured"
    return f"copy bandwidth {copy:.3g} GB/s (torch copy_ of 256 MiB, bytes read + written, median of 5)"


def _row(result: dict, peers: list[str], notes: "_Footnotes", copy_gb_per_s: float | None) -> list[str]:
    case = result["case"]
    dr = result["deltarule"]
    row = [case["name"], case["kind"], f"{case['B']}x{case['T']}", f"{case['Hq']}/{case['Hk']}/{case['Hv']}"]
    if dr["status"] == "ok":
        gb = dr["gb_per_s"]
        row += [_ms(dr["median_ms"]), _spread(dr),
                _ms(dr["plan"]["median_ms"]) if "plan" in dr else "-",
                _ms(dr["kernel_ms"]) if "kernel_ms" in dr else "-",
                f"{dr['overhead_us']:.1f}" if "overhead_us" in dr else "-",
                _si(dr["tokens_per_s"]), f"{dr['gflop_per_s']:.3g}",
                "-" if gb is None else f"{gb:.3g}",
                "-" if gb is None or not copy_gb_per_s else f"{100 * gb / copy_gb_per_s:.0f}%"]
    else:
        row += [f"err{notes.mark('deltarule: ' + dr['reason'])}"] + ["-"] * 8
    mismatches = []
    for name in peers:
        p = result["peers"][name]
        if p["status"] == "ok":
            mark = notes.mark(p["note"]) if p.get("note") else ""
            low, high = p["ratio_range"]
            row += [_ms(p["median_ms"]) + mark, f"{p['ratio']:.3g}x", f"[{low:.3g}-{high:.3g}]"]
            if not p["match"]:
                err = "non-finite" if p["rel_err"] is None else f"{p['rel_err']:.1e}"
                mismatches.append(f"{name} {err}")
        else:
            tag = "skip" if p["status"] == "skipped" else "err"
            row += [tag + notes.mark(f"{name}: {p['reason']}"), "-", "-"]
    ran = any(result["peers"][n]["status"] == "ok" for n in peers)
    row.append("MISMATCH " + ", ".join(mismatches) if mismatches else ("ok" if ran else "-"))
    return row


class _Footnotes:
    """Numbered, deduplicated footnotes for skip reasons and notes."""

    def __init__(self):
        self._texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self._texts:
            self._texts.append(text)
        return f"[{self._texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self._texts, 1)]


def align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    left = {0, 1}
    return [
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def _spread(entry: dict) -> str:
    """Half the spread of an entry's samples over rounds, as a share of their median."""
    return f"{50 * (entry['max_ms'] - entry['min_ms']) / entry['median_ms']:.0f}%"


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 1000 else f"{x:.4g}"


def _si(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"
