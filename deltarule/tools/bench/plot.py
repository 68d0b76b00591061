"""Bar chart of the median time per case per implementation (log scale)."""

from __future__ import annotations


def plot(results: list[dict], peers: list[str], path: str, title: str) -> None:
    """Save a grouped bar chart to `path` with matplotlib's Agg canvas.

    One group per case, one bar per implementation that ran; the y axis is
    the median time in ms on a log scale.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    impls = ["deltarule", *peers]
    names = [r["case"]["name"] for r in results]
    fig = Figure(figsize=(max(6.0, 1.0 * len(names) + 2.0), 5.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for x, r in enumerate(results):
            entry = r["deltarule"] if impl == "deltarule" else r["peers"][impl]
            if entry["status"] == "ok":
                xs.append(x + (i - (len(impls) - 1) / 2) * width)
                ys.append(entry["median_ms"])
        ax.bar(xs, ys, width, label=impl)
    ax.set_yscale("log")
    ax.set_ylabel("median time per call (ms, log scale)")
    ax.set_xticks(range(len(names)), labels=names, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
