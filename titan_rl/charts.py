"""The report's charts: matplotlib figures returned as SVG text to inline in one HTML page.

Only the SVG backend draws (a bare `Figure`, never pyplot, so no display is opened). Text
stays <text> (svg.fonttype "none") so titles are searchable and sharp at any zoom. The same
data gives the same bytes: a fixed hash salt, no date in the metadata. Every id in a chart
gets a prefix made from the chart's own bytes, so several charts inlined in one page never
share an id (matplotlib numbers them from 1 in every figure).
"""

from __future__ import annotations

import hashlib
import html
import io
import math
import re
from collections.abc import Sequence

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullLocator

W, H = 600, 320  # pixels: the SVG backend draws at 72 dpi and we write 1 pt as 1 px
ML, MR, MT, MB = 78, 20, 46, 52  # margins: left (y tick labels), right, top (title), bottom (x labels)
MB_ROTATED = 84  # bottom margin under slanted bar labels
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
NOTE_GREEN = "#2a7a2a"
ZERO_BAND = 22  # pixels under a log axis where exact zeros are drawn

RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "titan_rl.charts",
    "text.parse_math": False,  # labels are data (engine names...): a '$' is a dollar sign
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial"],  # DejaVu: what matplotlib measures text with
    "font.size": 11,
    "axes.labelsize": 12,
    "axes.edgecolor": "#444",
    "axes.linewidth": 1.0,
    "xtick.labelsize": 11,
    "ytick.labelsize": 11,
    "xtick.major.size": 3,
    "ytick.major.size": 3,
    "grid.color": "#e3e3e3",
    "grid.linewidth": 1.0,
    "legend.fontsize": 11,
}
SVG_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}


def finite(v) -> bool:
    """A real, finite number (not a bool, None or NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About n round ticks whose first is <= lo and last is >= hi (the axis spans them)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    ticks = MaxNLocator(nbins=n, steps=[1, 2, 2.5, 5, 10], integer=integer).tick_values(lo, hi)
    return [round(float(t), 12) for t in ticks]


def _tick_label(t: float) -> str:
    if t == 0:
        return "0"
    if abs(t) < 1e-3 or abs(t) >= 1e5:
        return f"{t:.0e}"
    return f"{t:.6g}"


def _figure(title: str, xlabel: str, ylabel: str, mb: int = MB) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(W / 72, H / 72), dpi=72)
    ax = fig.add_axes((ML / W, mb / H, (W - ML - MR) / W, (H - MT - mb) / H))
    fig.suptitle(title, y=1 - 6 / H, va="top", fontsize=15, fontweight="bold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    # fixed places, as wide tick labels ("0 (bitwise)") must not push the labels off the chart
    ax.xaxis.set_label_coords(0.5, -(mb - 24) / (H - MT - mb))
    ax.yaxis.set_label_coords(-(ML - 24) / (W - ML - MR), 0.5)
    ax.grid(axis="y")
    ax.set_axisbelow(True)
    return fig, ax


def _note(ax: Axes, text: str, color: str = NOTE_GREEN) -> None:
    """A message in a white box at the top of the plot area (readable over bars and lines)."""
    ax.text(0.5, 1 - 8 / (ax.bbox.height or 1), text, transform=ax.transAxes, ha="center", va="top",
            fontsize=13, fontweight="bold", color=color, zorder=5,
            bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": color})


def _set_ticks(ax: Axes, axis: str, ticks: Sequence[float], labels: Sequence[str] | None = None) -> None:
    set_ticks = ax.set_xticks if axis == "x" else ax.set_yticks
    set_ticks(list(ticks), list(labels) if labels is not None else [_tick_label(t) for t in ticks])


def _svg(fig: Figure, title: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata=SVG_METADATA)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # inline in HTML: no XML prolog, no DOCTYPE
    prefix = "c" + hashlib.sha1(svg.encode()).hexdigest()[:10] + "-"
    svg = re.sub(r'(\sid="|url\(#|xlink:href="#)', lambda m: m.group(1) + prefix, svg)
    # size in CSS pixels (matplotlib writes pt, 4/3 larger), and a name for screen readers
    return re.sub(r'width="[0-9.]+pt" height="[0-9.]+pt"',
                  f'width="{W}" height="{H}" role="img" aria-label="{html.escape(title)}"', svg, count=1)


def _linear_y(ax: Axes, values: list[float], top_pad: float = 0.0) -> None:
    lo, hi = min(values), max(values)
    if lo == hi:
        lo, hi = lo - (abs(lo) * 0.1 or 1.0), hi + (abs(hi) * 0.1 or 1.0)
    ticks = nice_ticks(lo, hi)
    span = ticks[-1] - ticks[0]
    ax.set_ylim(ticks[0], ticks[-1] + span * top_pad)
    _set_ticks(ax, "y", ticks)


def _log_y(ax: Axes, values: list[float]) -> float | None:
    """Log10 y axis over whole decades. If some values are exactly 0, returns the y to draw
    them at: a band under the lowest decade, labelled '0 (bitwise)' (log has no 0)."""
    pos = [v for v in values if v > 0]
    lo, hi = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
    hi = max(hi, lo + 1)
    step = max(1, math.ceil((hi - lo) / 6))
    ticks = [10.0 ** e for e in range(lo, hi + 1, step)]
    labels = [_tick_label(t) for t in ticks]
    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(NullLocator())
    plot_h = H - MT - MB
    top = hi + 0.03 * (hi - lo)
    if not any(v == 0 for v in values):
        ax.set_ylim(10.0 ** lo, 10.0 ** top)
        _set_ticks(ax, "y", ticks, labels)
        return None
    band = (top - lo) * ZERO_BAND / (plot_h - ZERO_BAND)  # in decades
    zero_y = 10.0 ** (lo - band + band * 6 / ZERO_BAND)
    ax.set_ylim(10.0 ** (lo - band), 10.0 ** top)
    ax.axhline(10.0 ** lo, color="#888", linewidth=1, linestyle=(0, (3, 3)))
    _set_ticks(ax, "y", ticks + [zero_y], labels + ["0 (bitwise)"])
    ax.get_yticklabels()[-1].set_color(NOTE_GREEN)
    return zero_y


def line_chart(series: list[tuple[str, list[tuple[float, float]]]], title: str, xlabel: str, ylabel: str,
               log: bool = False, zero_means_equal: bool = False, ylim: tuple[float, float] | None = None) -> str:
    """series: [(label, [(x, y), ...]), ...]. log: log10 y axis (zeros drawn on a '0' band).
    zero_means_equal: if every y is exactly 0, say 'bitwise equal' on the chart."""
    series = [(name, sorted((x, y) for x, y in pts if finite(x) and finite(y))) for name, pts in series]
    series = [(name, pts) for name, pts in series if pts]
    with matplotlib.rc_context(RC):
        fig, ax = _figure(title, xlabel, ylabel)
        if not series:
            ax.set_xticks([])
            ax.set_yticks([])
            _note(ax, "no data recorded", color="#777")
            return _svg(fig, title)
        xs = [x for _, pts in series for x, _ in pts]
        ys = [y for _, pts in series for _, y in pts]
        all_zero = zero_means_equal and all(y == 0 for y in ys)
        zero_y = None
        if all_zero:
            _linear_y(ax, [0.0, 1.0], top_pad=34 / (H - MT - MB - 34))  # room for the note
        elif log and any(y > 0 for y in ys) and all(y >= 0 for y in ys):
            zero_y = _log_y(ax, ys)
            ax.set_ylabel(f"{ylabel} (log scale)")
        else:
            _linear_y(ax, ys + list(ylim or ()), top_pad=8 / (H - MT - MB - 8))
        xlo, xhi = min(xs), max(xs)
        if xhi == xlo:
            xlo, xhi = xlo - 1, xhi + 1
        xt = nice_ticks(xlo, xhi, 6, integer=all(float(x).is_integer() for x in xs))
        xt = [t for t in xt if xlo <= t <= xhi] or [xlo, xhi]
        pad = (xhi - xlo) * 10 / (W - ML - MR - 20)
        ax.set_xlim(xlo - pad, xhi + pad)
        _set_ticks(ax, "x", xt)
        for i, (name, pts) in enumerate(series):
            px = [x for x, _ in pts]
            py = [zero_y if y == 0 and zero_y is not None else y for _, y in pts]
            ax.plot(px, py, color=COLORS[i % len(COLORS)], linewidth=1.8 if len(pts) > 1 else 0,
                    marker="o", markersize=5.2 if len(pts) <= 60 else 3.0, markeredgewidth=0, label=name,
                    clip_on=False)  # the data lie inside the limits: a point on the frame shows whole
        if len(series) > 1:  # one row between the title and the plot, right-aligned
            ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(series), frameon=False,
                      borderaxespad=0.1, handlelength=1.6, columnspacing=1.2)
        if all_zero:
            _note(ax, f"bitwise equal: exactly 0 at all {len(ys)} points")
        return _svg(fig, title)


def bar_chart(labels: list[str], values: list[float], title: str, xlabel: str, ylabel: str,
              annotations: list[str] | None = None, colors: list[str] | None = None, note: str | None = None,
              rotate: bool = False) -> str:
    """One bar per label; annotations: text above each bar; rotate: slant long label rows."""
    vals = [v if finite(v) else 0.0 for v in values]
    with matplotlib.rc_context(RC):
        fig, ax = _figure(title, xlabel, ylabel, mb=MB_ROTATED if rotate else MB)
        top = max(vals, default=0.0)
        _linear_y(ax, [0.0] + vals + [top * 1.15 if top > 0 else 1.0])
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
        n = max(1, len(labels))
        ax.set_xlim(-0.5, n - 0.5)
        ax.tick_params(axis="x", length=0, labelsize=10)
        if labels:
            ax.bar(range(len(vals)), vals, width=0.76, color=colors or COLORS[0])
            ax.set_xticks(range(len(labels)), labels, rotation=35 if rotate else 0,
                          ha="right" if rotate else "center", rotation_mode="anchor")
        else:
            ax.set_xticks([])
        for i, text in enumerate(annotations or []):
            if text:
                ax.annotate(text, (i, vals[i]), xytext=(0, 3), textcoords="offset points", ha="center",
                            va="bottom", fontsize=9, color="#333")
        if note:
            _note(ax, note)
        return _svg(fig, title)


def scatter_chart(xs: list[float], ys: list[float], title: str, xlabel: str, ylabel: str,
                  max_points: int = 3000, note: str | None = None) -> str:
    """y against x with the diagonal y = x dashed; at most max_points points drawn (evenly strided)."""
    pts = [(x, y) for x, y in zip(xs, ys) if finite(x) and finite(y)]
    step = max(1, math.ceil(len(pts) / max_points))
    shown = pts[::step]
    lo = min([0.0] + [min(p) for p in pts]) if pts else 0.0
    hi = max([1.0] + [max(p) for p in pts]) if pts else 1.0
    if lo >= -0.01 and hi <= 1.01:  # probabilities (rounding may put a few a hair above 1): clamp to [0, 1]
        ticks = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
        shown = [(min(max(x, 0.0), 1.0), min(max(y, 0.0), 1.0)) for x, y in shown]
    else:
        ticks = nice_ticks(lo, hi)
    lo, hi = ticks[0], ticks[-1]
    with matplotlib.rc_context(RC):
        fig, ax = _figure(title, xlabel, ylabel)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        _set_ticks(ax, "x", ticks)
        _set_ticks(ax, "y", ticks)
        ax.plot([lo, hi], [lo, hi], color="#999", linewidth=1, linestyle=(0, (4, 3)))
        ax.plot([x for x, _ in shown], [y for _, y in shown], linestyle="none", marker="o", markersize=3.6,
                markeredgewidth=0, color=COLORS[0], alpha=0.55)
        ax.text(1 - 6 / (W - ML - MR), 8 / (H - MT - MB), f"{len(shown)} of {len(pts)} tokens shown; "
                "dashed line: y = x", transform=ax.transAxes, ha="right", va="bottom", fontsize=10, color="#555")
        if note:
            _note(ax, note)
        return _svg(fig, title)
