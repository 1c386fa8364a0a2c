"""One function per figure; each takes plain records (dicts/lists/tensors) and returns a matplotlib Figure."""
from __future__ import annotations

import math

import numpy as np

from ._optional import require

require("matplotlib", "notebooks", "ctxpatch_lite.plots")
import matplotlib  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

PALETTE = {"bfloat16-naive": "#1f77b4", "bfloat16-stable": "#ff7f0e", "float32-naive": "#2ca02c",
           "float32-stable": "#d62728", "float64-naive": "#9467bd", "float64-stable": "#8c564b"}


def style():
    """The notebooks' look: seaborn's whitegrid/notebook theme as matplotlib ships it (``seaborn-v0_8-*``), so the
    kernel does not import seaborn and pandas (42 MB resident, which Binder's 2 GB cannot spare)."""
    plt.style.use(["seaborn-v0_8-whitegrid", "seaborn-v0_8-notebook"])
    plt.rcParams.update({"font.size": plt.rcParams["font.size"] * 0.95})
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 110, "axes.titleweight": "bold"})


def _color(label: str, i: int):
    for key, c in PALETTE.items():
        if label.startswith(key):
            return c
    return plt.rcParams["axes.prop_cycle"].by_key()["color"][i % 10]


MARKERS = {"bfloat16-naive": ("o", "-"), "bfloat16-stable": ("s", "--"), "float32-naive": ("^", "-."),
           "float32-stable": ("D", ":"), "float64-naive": ("v", "-"), "float64-stable": ("P", "--")}


def _marker(label: str, i: int) -> tuple[str, str]:
    """A marker and a line style per configuration, so that lines stay apart in greyscale and when they overlap."""
    for key, ml in MARKERS.items():
        if label.startswith(key):
            return ml
    return ("o^sDvP"[i % 6], ["-", "--", "-.", ":"][i % 4])


def _integer_ticks(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))


def _positive(xs, floor=1e-12):
    return [max(float(x), floor) for x in xs]


THEOREM1, STABLE = "#ffc48a", "#d9c6f2"      # the patches of Theorem 1; what Appendix B's stable variant adds


def block_diagram():
    """A Gemma 3 decoder block with the quantities of Theorem 1 labelled (v, z, h_g, h), its two residual additions
    drawn as ⊕ nodes, and the sites its patches act on: orange for Theorem 1 (rank-1 ΔW_gate, ΔW_up; the scale patch
    Δm), violet for what Appendix B's stable variant adds (a rank-1 ΔW_down)."""
    fig, ax = plt.subplots(figsize=(13.5, 4.4))
    ax.set_xlim(0, 17.4)
    ax.set_ylim(0.2, 6.2)
    ax.axis("off")
    hgt = 0.95
    boxes = {   # name: (x, y, width, text, colour)
        "x": (0.1, 1.6, 1.45, "x\n(layer input)", "#eeeeee"), "in": (1.95, 1.6, 1.45, "input\nRMSNorm", "#dde8f5"),
        "attn": (3.8, 1.6, 1.55, "attention\n(the context\nenters here)", "#dde8f5"),
        "pa": (5.75, 1.6, 1.45, "post-attn\nRMSNorm", "#dde8f5"),
        "pf": (7.175, 4.3, 1.45, "pre-FF\nRMSNorm", "#dde8f5"), "gu": (9.3, 4.3, 1.6, "W_gate, W_up\n+ rank-1 ΔW", THEOREM1),
        "down": (11.8, 4.3, 1.45, "W_down\n+ rank-1 ΔW", STABLE),
        "post": (13.75, 4.3, 1.95, "post-FF RMSNorm\nh = N(W_down h_g)\nscale m + Δm", THEOREM1),
        "out": (15.95, 1.6, 1.3, "out", "#eeeeee"),
    }
    for x, y, w, text, color in boxes.values():
        ax.add_patch(matplotlib.patches.FancyBboxPatch((x, y), w, hgt, boxstyle="round,pad=0.05", fc=color,
                                                       ec="#555555", lw=1, ls="--" if color == STABLE else "-"))
        ax.text(x + w / 2, y + hgt / 2, text, ha="center", va="center", fontsize=8)
    mid = 1.6 + hgt / 2
    plus = {"v": (7.9, mid), "out": (14.725, mid)}
    for px, py in plus.values():
        ax.add_patch(matplotlib.patches.Circle((px, py), 0.22, fc="white", ec="#333333", lw=1.2))
        ax.text(px, py, "+", ha="center", va="center", fontsize=12)

    def right(k):
        x, y, w, *_ = boxes[k]
        return (x + w, y + hgt / 2)

    def left(k):
        x, y, *_ = boxes[k]
        return (x, y + hgt / 2)

    def arrow(a, b, label="", color="#333333", dx=0.0, dy=0.14, **kw):
        ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="->", color=color, **kw))
        if label:
            ax.text((a[0] + b[0]) / 2 + dx, (a[1] + b[1]) / 2 + dy, label, fontsize=11, color="#b03000",
                    weight="bold", ha="center")

    arrow(right("x"), left("in"))
    arrow(right("in"), left("attn"))
    arrow(right("attn"), left("pa"))
    arrow(right("pa"), (plus["v"][0] - 0.22, mid))
    arrow((plus["v"][0], mid + 0.22), (plus["v"][0], 4.3), "v", dx=0.25, dy=-0.1)
    arrow(right("pf"), left("gu"), "z")
    arrow(right("gu"), left("down"), "h_g")
    arrow(right("down"), left("post"))
    arrow((plus["out"][0], 4.3), (plus["out"][0], mid + 0.22), "m ⊙ h", dx=0.55, dy=-0.1)
    arrow((plus["out"][0] + 0.22, mid), left("out"))
    # the residuals: x around attention into the first ⊕, v straight along into the second
    arrow((0.825, 1.6), (plus["v"][0] - 0.05, mid - 0.21), color="#888888", connectionstyle="arc3,rad=0.25")
    ax.text(4.35, 0.55, "residual: v = x + RMSNorm_post-attn(attention)", fontsize=8, color="#555555", ha="center")
    arrow((plus["v"][0] + 0.22, mid), (plus["out"][0] - 0.22, mid), color="#888888")
    ax.text(11.25, mid - 0.42, "residual: out = v + m ⊙ h", fontsize=8, color="#555555", ha="center")
    ax.text(0.1, 5.85, "One Gemma 3 decoder block and where the patches act", fontsize=11, weight="bold")
    legend = [matplotlib.patches.Patch(fc=THEOREM1, ec="#555555", label="Theorem 1: rank-1 ΔW_gate, ΔW_up; scale Δm"),
              matplotlib.patches.Patch(fc=STABLE, ec="#555555", ls="--",
                                       label="Appendix B (stable variant) adds a rank-1 ΔW_down")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(0.0, 0.93), fontsize=8, frameon=False, ncol=1)
    return fig


def headline(rows: list[dict], floors: dict | None = None):
    """The claim in one figure: for each run of the query token (``rows``: ``label``, ``linf`` = its largest logit
    difference from the model that read the whole prompt, ``token`` = the token it picks, ``matches``), a point on a
    log scale (a point: its distance; a bar's length would mean nothing on a log axis); ``floors``: {label: value} reference lines (e.g. one float32 ulp of the logits, and the baseline's own
    rounding), drawn in grey with distinct dashes."""
    fig, ax = plt.subplots(figsize=(8.6, 1.1 + 0.7 * len(rows)))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        color = "#2ca02c" if r["matches"] else "#d62728"
        x = max(float(r["linf"]), 1e-12)
        ax.plot([x], [y], "o", color=color, ms=12, zorder=3)            # a point: on a log axis a bar's length means nothing
        ax.text(x * 2.2, y, f"top token {r['token']!r}" + (" (the same)" if r["matches"] else " (another)"),
                va="center", fontsize=9, zorder=4, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
    for j, (label, value) in enumerate((floors or {}).items()):
        ax.axvline(value, color="0.4", ls=(":", "--")[j % 2], lw=1.3, label=label)
    if floors:
        ax.legend(loc="upper right", fontsize=8, frameon=True)          # the bars' labels stay clear of the lines
    ax.set_yticks(ys, [r["label"] for r in rows], fontsize=9)
    ax.set_xscale("log")
    lo = min(max(float(r["linf"]), 1e-12) for r in rows)
    ax.set_xlim(min([lo, *(floors or {}).values()]) / 30, max(float(r["linf"]) for r in rows) * 150)
    ax.set_ylim(-0.6, len(rows) - 0.2)
    ax.set_xlabel("largest |logit − full-context logit| over the vocabulary (log scale)")
    ax.set_title("The query token alone, with and without the patches, against the model that read the prompt",
                 fontsize=10)
    fig.tight_layout()
    return fig


def per_token(runs: dict, title: str = "", floors: dict | None = None):
    """Figure 3 style: per generated token, L∞ logit distance and TVD for each labelled run, one marker and line
    style per run (they overlap in places); a cross in the run's colour (black edge) marks a step whose top token
    differs from the baseline's, with one neutral legend entry for all crosses.
    ``floors``: optional {label: value} reference lines on the L∞ panel (e.g. one ulp of the dtype at the logits'
    magnitude, or the unpatched model's distance), drawn dotted in grey and named in the legend."""
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.4), sharex=True)
    n = len(runs)
    for i, (label, run) in enumerate(runs.items()):
        steps = run["steps"]
        xs = [s["step"] for s in steps]
        color = _color(label, i)
        marker, ls = _marker(label, i)
        for ax, key in zip(axes, ("linf", "tvd")):
            ys = _positive([s[key] for s in steps])
            ax.plot(xs, ys, ls, marker=marker, ms=4 + 1.5 * (n - 1 - i), mfc="none" if i % 2 else color, mec=color,
                    mew=1.3, lw=1.3, color=color, label=label, zorder=3 + i)   # smaller markers on top
            bad = [(x, y) for x, y, s in zip(xs, ys, steps) if not s["match"]]
            if bad:
                ax.plot(*zip(*bad), "X", color=color, mec="black", mew=1.0, ms=11, zorder=20)
    if any(not s["match"] for run in runs.values() for s in run["steps"]):   # one legend entry for every cross
        axes[0].plot([], [], "X", color="white", mec="black", mew=1.0, ms=11,
                     label="top token differs (cross in the run's colour)")
    for j, (name, value) in enumerate((floors or {}).items()):
        axes[0].axhline(value, color=("0.35", "0.55", "0.2")[j % 3], ls=(":", (0, (6, 3)), (0, (1, 1)))[j % 3], lw=1.3,
                        label=name)
    axes[0].set_ylabel("L∞ logit distance (logit units)")
    axes[1].set_ylabel("TVD (probability)")
    axes[1].set_xlabel("generated token (step)")
    _integer_ticks(axes[1])
    for ax in axes:
        ax.set_yscale("log")
    axes[0].set_title(title or "Patched (no context) vs baseline (full context); × = token mismatch")
    handles, labels = axes[0].get_legend_handles_labels()       # below the panels: the plots keep the full width
    ncol = min(3, len(labels))
    rows = -(-len(labels) // ncol) if labels else 0
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.01, 1, 1))
    return fig


def summary(rows: list[dict], title: str = "Summary over prompts"):
    """Figure 4 style: left TVD per step (log scale) per configuration; right token match with counts."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.6, 1]})
    labels = [r["label"] for r in rows]
    data = [np.log10(_positive(r["tvd"], 1e-16)) for r in rows]
    a1.boxplot(data, orientation="vertical", showfliers=True)
    a1.set_xticks(range(1, len(labels) + 1), labels, rotation=20, fontsize=8)
    a1.set_ylabel("log10 TVD per token")
    a1.set_title("TVD (log scale; lower is better)")
    pct = [100.0 * r["n_match"] / r["n_tokens"] for r in rows]
    bars = a2.bar(range(len(rows)), pct, color=[_color(l, i) for i, l in enumerate(labels)],
                  hatch=["//" if "recorded" in l else "" for l in labels], edgecolor="white")
    for b, r in zip(bars, rows):
        a2.text(b.get_x() + b.get_width() / 2, b.get_height() + 1, f"{r['n_match']}/{r['n_tokens']}", ha="center",
                fontsize=8)
    a2.set_xticks(range(len(rows)), labels, rotation=20, fontsize=8)
    a2.set_ylim(0, 110)
    a2.set_ylabel("token match (%)")
    a2.set_title("token match (higher is better)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def paired_tvd(panels: list, title: str = ""):
    """Token by token: one panel per ``(x_label, x_tvds, y_label, y_tvds)`` in ``panels`` (per-token TVDs of two
    configurations on the same tokens, in the same order), y's TVD against x's on log axes, with the diagonal y = x;
    up to three panels in a row, four as a 2 x 2 grid.
    Each panel's title counts the tokens above the diagonal (y further from the baseline than x), below it and on it.
    A TVD of exactly 0 cannot sit on a log axis: such tokens are counted in the panel's legend and not drawn."""
    if not panels:
        raise ValueError("paired_tvd needs at least one panel (x_label, x_tvds, y_label, y_tvds)")
    pairs = []
    for x_label, xs, y_label, ys in panels:
        xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
        if xs.size == 0 or xs.size != ys.size:
            raise ValueError(f"paired_tvd: {y_label} has {ys.size} TVDs and {x_label} {xs.size}; pair them token by "
                             "token (and give at least one)")
        if (np.concatenate([xs, ys]) < 0).any() or not np.isfinite(np.concatenate([xs, ys])).all():
            raise ValueError("paired_tvd: TVDs are distances, finite and >= 0")
        pairs.append((x_label, xs, y_label, ys))
    values = np.concatenate([v for _, xs, _, ys in pairs for v in (xs, ys)])
    pos = values[values > 0]
    lo, hi = (pos.min() / 2, pos.max() * 2) if pos.size else (1e-3, 1.0)
    ncols = 2 if len(pairs) == 4 else min(len(pairs), 3)                 # four panels as a 2 x 2 grid
    nrows = -(-len(pairs) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols, 4.4 * nrows), squeeze=False)
    for ax in axes.flat[len(pairs):]:
        ax.set_visible(False)
    for i, (ax, (x_label, xs, y_label, ys)) in enumerate(zip(axes.flat, pairs)):
        drawn = (ys > 0) & (xs > 0)
        above, below = int((ys > xs).sum()), int((ys < xs).sum())
        ax.plot([lo, hi], [lo, hi], color="black", lw=1, ls="--", label="y = x: the same TVD")
        ax.plot(xs[drawn], ys[drawn], _marker(y_label, i)[0], color=_color(y_label, i), alpha=0.75, ms=6,
                label=f"one token each ({int(drawn.sum())})" + (f"; {xs.size - int(drawn.sum())} with a TVD of 0, "
                                                                "not drawn" if not drawn.all() else ""))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_aspect("equal")
        ax.set_xlabel(f"TVD, {x_label}", fontsize=9)
        ax.set_ylabel(f"TVD, {y_label}", fontsize=9)
        ax.set_title(f"above y = x on {above} of {xs.size},\nbelow on {below}, on it on {xs.size - above - below}",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.07 / nrows) if title else None)   # the two-line titles clear the suptitle
    return fig


def rounding_difference(h_C, dh, scale, layer: int, same=None):
    """Lesson 04b, Part 1, one layer's every coordinate: left, the rounding difference |h_hat_k - h_C,k| against
    |h_C,k| on log axes with the line y = x (above it the difference is larger than the value itself); right, the
    difference over ``scale`` (one bfloat16 step of the size of the terms the coordinate sums, the ruler the lesson
    predicts it by), on a log axis, with the line at 1. ``same`` (optional boolean mask): the coordinates whose
    bfloat16 product came out bit-identical in the two passes, drawn in their own colour on the left. Sizes of
    exactly 0 cannot sit on a log axis: they are counted in the legends, not drawn."""
    h_C, dh, scale = (np.abs(_host(x)).astype(float).reshape(-1) for x in (h_C, dh, scale))
    if not (h_C.size == dh.size == scale.size) or h_C.size == 0:
        raise ValueError("rounding_difference needs h_C, dh and scale of one common, nonzero length")
    if not (np.isfinite(h_C).all() and np.isfinite(dh).all() and np.isfinite(scale).all()):
        raise ValueError("rounding_difference: every value must be finite")
    same = np.zeros(h_C.size, dtype=bool) if same is None else _host(same).astype(bool).reshape(-1)
    if same.size != h_C.size:
        raise ValueError("rounding_difference: same must mark each coordinate (one boolean per value of h_C)")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    drawn = (h_C > 0) & (dh > 0)
    over = int((dh > h_C).sum())
    zeros = h_C.size - int(drawn.sum())
    for mask, color, what in ((~same, "tab:blue", "product differs" if same.any() else "one coordinate each"),
                              (same, "tab:orange", "product bit-identical")):
        if (mask & drawn).any():
            ax.plot(h_C[mask & drawn], dh[mask & drawn], ".", color=color, alpha=0.5, ms=4,
                    label=f"{what} ({int((mask & drawn).sum())})")
    if zeros:
        ax.plot([], [], " ", label=f"{zeros} with a 0, not drawn")
    lo = min(h_C[drawn].min(), dh[drawn].min()) / 2 if drawn.any() else 1e-6
    hi = max(h_C[drawn].max(), dh[drawn].max()) * 2 if drawn.any() else 1.0
    ax.plot([lo, hi], [lo, hi], "--", color="black", lw=1, label=f"y = x (above it: {over} coordinates)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(r"$|h_{C,k}|$")
    ax.set_ylabel(r"$|\hat h_k - h_{C,k}|$")
    ax.set_title(f"layer {layer}: the rounding difference against the value", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ok = (scale > 0) & (dh > 0)
    ratio = dh[ok] / scale[ok]
    if ratio.size:
        bins = np.logspace(math.floor(math.log10(ratio.min())), max(1, math.ceil(math.log10(ratio.max()))), 30)
        ax2.hist(ratio, bins=bins, color="0.55", label=f"coordinates ({ratio.size}; largest {ratio.max():.2g})")
    ax2.axvline(1.0, color="black", ls="--", lw=1, label="one step of the terms' size")
    ax2.set_xscale("log")
    ax2.set_xlabel(r"$|\hat h_k - h_{C,k}|$ / one bfloat16 step of $\sum_j |W_{kj} h_{g,j}|$ (normalised)")
    ax2.set_ylabel("coordinates")
    ax2.set_title("the same difference, in steps of the terms' size", fontsize=10)
    ax2.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def singular_values(svals: dict):
    """Leading singular values of the dense patches: rank 1 means one nonzero value."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, (name, s) in enumerate(svals.items()):
        ax.semilogy(range(1, len(s) + 1), _positive(s, 1e-20), "o-", label=name)
    ax.set_xlabel("index (largest first)")
    _integer_ticks(ax)
    ax.set_ylabel("singular value")
    ax.set_title("Singular values of ΔW (rank 1: one value, the rest at rounding level)")
    ax.legend()
    fig.tight_layout()
    return fig


def _host(x) -> np.ndarray:
    """float64 numpy array of a tensor (on any device: ``.cpu()`` first) or an array-like."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def h_histogram(abs_h, n_zero: int, title: str = ""):
    """Histogram of |h_C,i| (log10), the full-context pass's normed MLP outputs over layers and tokens; the count of
    exact zeros (where the naive scale patch would fall back) in the title."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    vals = _host(abs_h)
    pos = vals[vals > 0]
    ax.hist(np.log10(pos), bins=80, color="#4c72b0")
    ax.set_yscale("log")                      # the point is the tail of tiny |h_i|: a few values among millions
    ax.set_xlabel("log10 |h_C,i|   (full-context h_C = N(W_down h_g); the patched h equals it up to rounding)")
    ax.set_ylabel("count (log scale)")
    ax.set_title(title or f"{vals.size:,} values of |h_C,i|; exact zeros: {n_zero}; "
                          f"min |h_C,i| = {pos.min():.2e}")
    fig.tight_layout()
    return fig


def secular_function(g, m, mu_root: float, hard_case: bool = False):
    """F(mu) of the App. B inversion on (-inf, min m^2), with its root, drawn against the distance to the pole,
    min m^2 - mu, on a log axis that runs towards the pole from left to right: the steep rise near the pole and the
    crossing at the root, however far from the pole it lies, both stay visible."""
    import torch

    from .stable import F
    g, m = torch.as_tensor(g).detach().cpu(), torch.as_tensor(m).detach().cpu()   # a figure is drawn on the host
    m2min = float((m.to(torch.float64) ** 2).min())
    root_dist = max(m2min - mu_root, 1e-12)
    far = max(root_dist * 100, 1.0)
    dists = np.logspace(math.log10(far), math.log10(min(root_dist / 100, 1e-6)), 600)
    Fs = F(torch.tensor(m2min - dists), g, m).numpy()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(dists, np.arcsinh(Fs), lw=1.5)
    ax.set_xscale("log")
    ax.invert_xaxis()                                    # towards the pole to the right, as mu grows
    ax.axhline(0, color="k", lw=0.8)
    ax.plot([root_dist], [0], "o", color="red", label=f"μ* = {mu_root:.6g}" + (" (hard case)" if hard_case else ""))
    ax.set_xlabel(f"distance to the pole, min m² − μ (log; min m² = {m2min:.3g})")
    ax.set_ylabel("asinh F(μ)")
    ax.set_title("Secular function of the RMSNorm inversion (monotone on (−∞, min m²))")
    ax.legend()
    fig.tight_layout()
    return fig


def distributions(values: dict, xlabel: str, title: str):
    """Overlaid histograms of log10 |x| for several labelled arrays (e.g. Δm per variant)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (label, v) in enumerate(values.items()):
        v = np.abs(_host(v))
        v = v[v > 0]
        ax.hist(np.log10(v), bins=60, histtype="step", lw=1.6, ls=_marker(label, i)[1], label=label,
                color=_color(label, i))
    ax.set_yscale("log")                      # the large entries are few: a linear count hides them
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count (log scale)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def update_norms(rows: list[dict], title: str = "Update norms per configuration (median over tokens)"):
    """Bar chart: matrix-patch norm vs vector (Δm) norm per configuration, log scale."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = np.arange(len(rows))
    # grey and purple: blue and orange mean naive and stable in the other figures
    ax.bar(x - 0.2, _positive([r["matrix_norm"] for r in rows]), 0.4, color="0.55", label="matrix patches (Frobenius)")
    ax.bar(x + 0.2, _positive([r["dm_norm"] for r in rows]), 0.4, color="#7b3294", label="scale patch Δm (L2)")
    ax.set_xticks(x, [r["label"] for r in rows], rotation=20, fontsize=8)
    ax.set_yscale("log")
    values = [v for r in rows for v in _positive([r["matrix_norm"], r["dm_norm"]])]
    ax.set_ylim(min(values) / 10, max(values) * 3)         # the bars start a decade below the smallest: none is a sliver
    ax.set_ylabel("norm")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def error_formula(rows: list[dict], title: str = "The bfloat16 error formulas, one coordinate per layer"):
    """Predicted against measured error at one coordinate per layer, log-log by size, with the line where they are
    equal. ``rows`` hold ``layer``, ``predicted_k`` and ``measured_k`` (dividing by the recorded h_C) and,
    optionally, ``predicted_actual_k`` and ``measured_actual_k`` (the actual divisor, at the same coordinate). A size
    of 0 cannot sit on a log axis: each divisor's points are drawn where both of its sizes are nonzero, and the
    legend says on how many layers. Colour: the layer."""
    if not rows:
        raise ValueError("error_formula needs at least one layer's row")
    rec = [(r["layer"], abs(r["predicted_k"]), abs(r["measured_k"])) for r in rows]
    drawn = [a for a in rec if a[1] > 0 and a[2] > 0]
    if any(not math.isfinite(v) for a in rec for v in a[1:]):
        raise ValueError("error_formula: every predicted and measured miss must be finite")
    pred, meas = np.array([a[1] for a in drawn]), np.array([a[2] for a in drawn])
    act = [(r["layer"], abs(r["predicted_actual_k"]), abs(r["measured_actual_k"])) for r in rows
           if "predicted_actual_k" in r]
    shown = [a for a in act if a[1] > 0 and a[2] > 0]
    fig, ax = plt.subplots(figsize=(6.2, 4.6))
    values = list(pred) + list(meas) + [v for a in shown for v in a[1:]]
    lo, hi = (min(values) / 2, max(values) * 2) if values else (1e-3, 1.0)
    ax.plot([lo, hi], [lo, hi], ":", color="0.5", label="measured = predicted")
    layers = [r["layer"] for r in rows]
    norm = matplotlib.colors.Normalize(min(layers), max(layers))
    pts = ax.scatter(pred, meas, c=[a[0] for a in drawn], cmap="viridis", norm=norm, edgecolors="black",
                     linewidths=0.4, s=40, zorder=3, label=r"recorded $h_C$: $(m_k + \Delta m_k)(\hat h_k - h_{C,k})$"
                     + ("" if len(drawn) == len(rec) else f" ({len(drawn)} of {len(rec)} layers nonzero)"))
    if act:
        ax.scatter([a[1] for a in shown], [a[2] for a in shown], c=[a[0] for a in shown], cmap="viridis", norm=norm,
                   marker="s", edgecolors="black", linewidths=0.4, s=30, zorder=3,
                   label=rf"actual $\hat h$: $m_k(\hat h_k - h_{{C,k}})$ ({len(shown)} of {len(act)} layers nonzero)")
    fig.colorbar(pts, ax=ax, label="layer")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted |miss_k|")
    ax.set_ylabel("measured |miss_k|")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def cause2_targets(ratio_fell, ratio_kept, title: str = "Fallbacks away from the zero scales, by the size of the target"):
    """Lesson 04b, cause 2: the histogram, over the coordinates with m_k != 0 of every layer patched alone, of
    |h_target,k| in bfloat16 steps of the layer's own (W_down h_g)_k where step 4's divisor was not 0 (``ratio_kept``,
    grey bars on a log axis whose bins have an edge at exactly 1, the one-step line of Exercise 4's rule), and one red
    tick per coordinate where it came out exactly 0 (``ratio_fell``), so that each fallback shows, however few. A
    ratio of exactly 0 (a target of exactly 0) cannot sit on a log axis: such coordinates are counted in the legend,
    never moved to a floor."""
    fell = np.asarray(ratio_fell, dtype=float)
    kept = np.asarray(ratio_kept, dtype=float)
    if fell.size + kept.size == 0:
        raise ValueError("cause2_targets needs at least one ratio")
    if (fell < 0).any() or (kept < 0).any() or not (np.isfinite(fell).all() and np.isfinite(kept).all()):
        raise ValueError("cause2_targets: ratios are sizes, finite and >= 0")
    pos = np.concatenate([fell[fell > 0], kept[kept > 0]])
    lo = math.floor(math.log10(min(pos.min(), 0.1))) if pos.size else -3
    hi = math.ceil(math.log10(max(pos.max(), 10.0))) if pos.size else 3
    bins = 10.0 ** (np.arange((hi - lo) * 5 + 1) / 5 + lo)              # five bins a decade; 10^0 = 1 is an edge
    bins[-lo * 5] = 1.0                                               # exactly, whatever 10.0 ** 0.0 rounds to
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    zk, zf = int((kept == 0).sum()), int((fell == 0).sum())
    ax.hist(kept[kept > 0], bins=bins, color="0.6", label=f"divisor nonzero ({kept.size} coordinates"
            + (f"; {zk} with a target of 0, not drawn" if zk else "") + ")")
    ax.plot(fell[fell > 0], np.full(int((fell > 0).sum()), 0.8), "|", color="tab:red", markersize=16, mew=2,
            label=f"fell back: divisor exactly 0, one tick each ({fell.size}"
            + (f"; {zf} with a target of 0, not drawn" if zf else "") + ")")
    ax.set_ylim(bottom=0.5)
    ax.axvline(1.0, color="black", ls="--", lw=1, label="one step of the own term (Exercise 4's rule)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(r"$|h_{\mathrm{target},k}|$ / one bfloat16 step of $(W_\mathrm{down} h_g)_k$")
    ax.set_ylabel("coordinates (log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def start_layer_sweep(rows: list[dict]):
    """Against the start layer, one line per label: token match, median L∞, ‖Δv‖ at the start layer (what the first
    patched layer must absorb) and the median update norms. Labels are dodged sideways by 0.2 layer so that equal
    values stay visible."""
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.7))
    labels = sorted({r["label"] for r in rows})
    for i, label in enumerate(labels):
        rs = sorted((r for r in rows if r["label"] == label), key=lambda r: r["start_layer"])
        dodge = 0.2 * (i - (len(labels) - 1) / 2)          # equal values side by side, not hidden behind each other
        xs = [r["start_layer"] + dodge for r in rs]
        c = _color(label, i)
        mk, ls = _marker(label, i)
        axes[0].plot(xs, [100 * r["n_match"] / r["n_tokens"] for r in rs], ls, marker=mk, color=c, label=label,
                     ms=7 - 2 * i, mfc="none" if i else c, mec=c, mew=1.3)
        axes[1].semilogy(xs, _positive([r["linf_median"] for r in rs]), ls, marker=mk, color=c, label=label)
        axes[2].semilogy(xs, _positive([r["dv_first"] for r in rs]), ls, marker=mk, color=c, label=label,
                         ms=7 - 2 * i, mfc="none" if i else c, mec=c, mew=1.3)
        axes[3].semilogy(xs, _positive([r["dm_norm"] for r in rs]), ls, marker=mk, color=c, label=f"{label}: Δm")
        axes[3].semilogy(xs, _positive([r["matrix_norm"] for r in rs]), ls, marker="s", color=c, alpha=0.6,
                         mfc="none", mec=c, mew=1.3, label=f"{label}: matrices")
    axes[0].set_ylabel("token match (%)")
    axes[0].set_ylim(-5, 105)
    axes[1].set_ylabel("median L∞ logit distance")
    axes[2].set_ylabel("‖Δv‖ at the start layer (median)")
    axes[3].set_ylabel("median update norm")
    for ax in axes:
        ax.set_xlabel("start layer (0-based)")
        _integer_ticks(ax)
    axes[0].legend(fontsize=7)
    axes[3].legend(fontsize=6)
    fig.suptitle("Start-layer sweep: layers below the start run on the query alone, unpatched", fontsize=11)
    fig.tight_layout()
    return fig


def family_errors(rows_by_dtype: dict):
    """Section 5 table as a figure: per family, the largest relative block error of Algorithm 1, one bar per dtype.

    ``rows_by_dtype``: dtype name -> list of ``FamilyRow`` dicts (``verify_architectures --json`` rows).
    """
    dtypes = list(rows_by_dtype)
    fams = [r["family"] for r in rows_by_dtype[dtypes[0]]]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.8 / len(dtypes)
    for i, dt in enumerate(dtypes):
        errs = {r["family"]: r["max_block_rel_error"] for r in rows_by_dtype[dt]}
        ax.bar(np.arange(len(fams)) + i * width, _positive((errs[f] for f in fams), 1e-18), width, label=dt,
               color=_color(f"{dt}-naive", i), hatch="" if i == 0 else "//", edgecolor="white")
    ax.axhline(1e-10, color="k", lw=0.8, ls="--", label="float64 target 1e-10")
    top = max(max(r["max_block_rel_error"] for r in rs) for rs in rows_by_dtype.values())
    ax.set_ylim(1e-18, max(top, 1e-10) * 30)              # no bar touches either edge
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(fams)) + 0.4 - width / 2, fams, rotation=35, ha="right")
    ax.set_ylabel("max relative block error")
    ax.set_title("Algorithm 1 on every family (tiny seeded models)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def appendix_d_search(result: dict):
    """Appendix D: the best residual an unconstrained upstream search reaches, against the lower bound."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    hist = np.minimum.accumulate(np.asarray(result["history"]))
    ax.plot(hist, label="best residual ||out' - out_C|| so far", color="#1f77b4")
    ax.axhline(result["lower_bound_on_residual"], color="#d62728", ls="--",
               label="lower bound ||dv|| - 2 sqrt(d) ||m||_inf")
    ax.axhline(max(result["trainable_scale_residual"], 1e-3), color="#2ca02c", ls=":",
               label=f"trainable scale patch: {result['trainable_scale_residual']:.0e}")
    ax.set_xlabel("Adam step over W_gate, W_up, W_down")
    ax.set_ylabel("residual")
    ax.set_ylim(bottom=0)
    ax.set_title("Appendix D: no upstream patch absorbs a large dv")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def appendix_e_steps(result: dict):
    """Appendix E, case 1: the per-token gradient steps telescope. Left: each step's norm (bars) and the norm of
    their running sum (line), which ends on the one-shot patch's norm (dashed). Right: the relative distance of the
    running sum from the one-shot patch, down to rounding level once the whole context is absorbed."""
    st = result["steps"]
    ks = np.asarray([s["k"] for s in st])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.0))
    for j, (part, c, off) in enumerate((("gate", "#1f77b4", -0.2), ("down", "#ff7f0e", 0.2))):
        a1.bar(ks + off, [s[f"{part}_step_norm"] for s in st], 0.4, color=c, alpha=0.45, label=f"W_{part} step")
        a1.plot(ks, [s[f"{part}_sum_norm"] for s in st], ["-o", "--s"][j], color=c, label=f"W_{part} running sum")
        a1.axhline(result[f"{part}_one_shot_norm"], color=c, ls=":", lw=1.2, label=f"W_{part} one-shot patch")
        a2.semilogy(ks, _positive([s[f"{part}_gap"] for s in st], 1e-17), ["-o", "--s"][j], color=c,
                    label=f"W_{part}")
    a1.set_xlabel("context tokens absorbed (k)")
    a1.set_ylabel("Frobenius norm")
    a1.set_title("steps and their running sum")
    a1.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0.0, -0.2), borderaxespad=0)
    a2.axhline(2.2e-16, color="0.45", ls=":", lw=1.2, label="float64 rounding (2.2e-16)")
    a2.set_xlabel("context tokens absorbed (k)")
    a2.set_ylabel("relative distance")
    a2.set_title("‖running sum − one-shot‖ / ‖one-shot‖")
    a2.legend(fontsize=7, loc="lower left")
    for ax in (a1, a2):
        _integer_ticks(ax)
    fig.suptitle(f"Appendix E: one unit trace step per context token ({result['family']}, layer {result['layer']})",
                 fontsize=11)
    fig.tight_layout()
    return fig


_SHORT = {"float32": "f32", "bfloat16": "bf16", "materialized": "mat", "factored": "fac", "recorded": "rec",
          "actual": "act", "batched": "batched", "step": "step"}


def _short_setting(label: str) -> str:
    parts = [p.split("=", 1)[-1] for p in label.split(", ")]
    return " ".join(_SHORT.get(p, p) for p in parts)


def claims_figure(rows: list[dict], ncols: int = 5):
    """Each judged claim's readings (dots: green passes the rule, red does not) against its threshold (dashed),
    one panel per rule (a claim with two rules gets two panels). Claims not runnable here are left out."""
    panels = [(r, i) for r in rows if r["readings"] for i in range(len(r["rules"]))]
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 2.5 * nrows), squeeze=False)
    for ax, (r, i) in zip(axes.flat, panels):
        rule = r["rules"][i]
        xs = [x["values"][rule["key"]] for x in r["readings"]]
        ys = range(len(xs))
        thr = rule["threshold"] if isinstance(rule["threshold"], (list, tuple)) else [rule["threshold"]]
        log = rule["log"] and all(v is not None and v > 0 for v in list(xs) + list(thr))
        colours = ["#1b7837" if x["rule_passes"][i] else "#b2182b" for x in r["readings"]]
        ax.scatter(xs, list(ys), c=colours, s=22, zorder=3)
        for t in thr:
            ax.axvline(t, color="#444444", ls="--", lw=1)
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks(list(ys))
        ax.set_yticklabels([_short_setting(x["setting"]) for x in r["readings"]], fontsize=6)
        ax.tick_params(axis="x", labelsize=7)
        part = f" (rule {i + 1} of {len(r['rules'])})" if len(r["rules"]) > 1 else ""
        ax.set_title(f"{r['id']}{part}: {r['verdict']}", fontsize=8)
        op = {"between": "in", ">=": "≥", ">": ">", "<=": "≤", "<": "<"}[rule["op"]]
        ax.set_xlabel(f"{rule['key']} (rule: {op} {', '.join(f'{t:g}' for t in thr)})", fontsize=7)
        ax.set_ylim(-0.7, len(xs) - 0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("Claims ledger: every reading's figure against the claim's threshold", fontsize=10)
    fig.tight_layout()
    return fig


def context_images(originals: list, pixel_values, names: list | None = None):
    """Each image of the context as given (top) and as the model sees it after the processor (bottom: resized and
    normalised pixel values mapped back to [0, 1])."""
    import torch

    n = len(originals)
    fig, axes = plt.subplots(2, n, figsize=(2.6 * n + 0.4, 5.0), squeeze=False)
    pv = torch.as_tensor(pixel_values).detach().to("cpu", torch.float32)
    for i, img in enumerate(originals):
        axes[0, i].imshow(img)
        axes[0, i].set_title((names or [f"image {i}"] * n)[i] + f"\n{img.size[0]} × {img.size[1]} px", fontsize=9)
        shown = ((pv[i].permute(1, 2, 0) - pv[i].min()) / (pv[i].max() - pv[i].min() + 1e-12)).numpy()
        axes[1, i].imshow(shown, interpolation="nearest")
        axes[0, i].grid(False)
        axes[1, i].grid(False)
        axes[1, i].set_title(f"what SigLIP sees: {shown.shape[1]} × {shown.shape[0]} px", fontsize=9)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    return fig


def attention_mask(mask, token_type_ids, labels: list):
    """The full-context pass's attention mask (row: the attending position, column: the attended one): causal text,
    each image's soft tokens a bidirectional block (outlined), the query in the last row."""
    import torch
    from matplotlib.patches import Rectangle

    m = torch.as_tensor(mask).detach().to("cpu").numpy().astype(float)
    tt = torch.as_tensor(token_type_ids).reshape(-1).tolist()[: m.shape[0]]
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    ax.imshow(m, cmap="Greys", vmin=0, vmax=1.6, interpolation="nearest")
    ax.grid(False)
    start = None
    for k, t in enumerate(tt + [0]):
        if t == 1 and start is None:
            start = k
        if t != 1 and start is not None:
            ax.add_patch(Rectangle((start - 0.5, start - 0.5), k - start, k - start, fill=False, ec="#d62728", lw=2,
                                   label="image block (bidirectional)" if not ax.patches else None))
            start = None
    q = m.shape[0] - 1
    ax.add_patch(Rectangle((-0.5, q - 0.5), m.shape[1], 1, fill=False, ec="#1f77b4", lw=2, label="the query's row"))
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_xlabel("attended position (token)")
    ax.set_ylabel("attending position (token)")
    ax.set_title("Attention mask of the full-context pass (dark: may attend)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def per_layer(series: dict, ylabel: str, title: str, log: bool = True, reference: dict | None = None):
    """One line per labelled series of per-layer values (distinct markers and styles), integer layer ticks;
    ``reference``: optional {label: value} horizontal lines."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (label, ys) in enumerate(series.items()):
        ys = _host(ys)
        ax.plot(range(len(ys)), _positive(ys, 1e-18) if log else ys, ["-", "--", "-.", ":"][i % 4],
                marker="osD^v"[i % 5], mfc="none" if i % 2 else None, mew=1.3, ms=7 - i, label=label)
    for j, (name, value) in enumerate((reference or {}).items()):
        ax.axhline(value, color="0.45", ls=":", lw=1.2, label=name)
    if log:
        ax.set_yscale("log")
    _integer_ticks(ax)
    ax.set_xlabel("layer (0-based)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _sweep_axes(rows: list[dict], baseline: list[dict] | None, height_per_job: float = 0.22):
    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(8.5, max(2.5, 0.8 + height_per_job * len(names))))
    base = {r.get("key", r["id"]): r for r in (baseline or [])}   # the same parameters, whatever the name
    return fig, ax, names, base


def sweep_token_match(rows: list[dict], baseline: list[dict] | None = None):
    """A sweep's token match per compare job (fraction of steps whose patched token is the full-context one), with
    the baseline sweep's value where the same job ran there; failed jobs are marked at 0 with a cross."""
    fig, ax, names, base = _sweep_axes(rows, baseline)
    y = np.arange(len(rows))
    frac = [r["n_match"] / r["n_tokens"] if r.get("n_tokens") else 0.0 for r in rows]
    ax.barh(y, frac, color="#4c72b0", height=0.6, label="this sweep")
    bad = [i for i, r in enumerate(rows) if r["status"] != "ok"]
    if bad:
        ax.plot([0] * len(bad), bad, "x", color="black", ms=8, mew=2, label="failed / not run")
    if base:
        pts = [(base[r["key"]]["n_match"] / base[r["key"]]["n_tokens"], i) for i, r in enumerate(rows)
               if r["key"] in base and base[r["key"]].get("n_tokens")]
        if pts:
            ax.plot(*zip(*pts), "o", mfc="none", mec="#c44e52", mew=1.5, ms=7, label="baseline")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("token match (fraction of steps)")
    ax.set_title("Token match per job")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    return fig


def sweep_linf(rows: list[dict], baseline: list[dict] | None = None):
    """A sweep's L-infinity logit error per compare job: the median over steps (dot) and the maximum (tick), log
    scale, with the baseline's maximum where the same job ran there."""
    fig, ax, names, base = _sweep_axes(rows, baseline)
    y = np.arange(len(rows))
    ok = [i for i, r in enumerate(rows) if r.get("linf_median") is not None]
    med, mx = _positive([rows[i]["linf_median"] for i in ok]), _positive([rows[i]["linf_max"] for i in ok])
    ax.hlines([y[i] for i in ok], med, mx, color="#999999", lw=1)      # a log axis has no zero for bars to start at
    ax.plot(med, [y[i] for i in ok], "o", color="#55a868", ms=6, label="median over steps")
    ax.plot(mx, [y[i] for i in ok], "|", color="black", ms=10, mew=2, label="max over steps")
    if base:
        pts = [(max(base[rows[i]["key"]]["linf_max"], 1e-12), i) for i in ok
               if rows[i]["key"] in base and base[rows[i]["key"]].get("linf_max") is not None]
        if pts:
            ax.plot(*zip(*pts), "o", mfc="none", mec="#c44e52", mew=1.5, ms=7, label="baseline max")
    ax.set_xscale("log")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("L∞ distance of the patched logits from the full-context logits")
    ax.set_title("Logit error per job")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    return fig
