"""Draw the two pictures notebook 08 and the image tests use (deterministic; matplotlib only) into
ctxpatch_lite/data/images/. They are this project's own drawings, released under CC0 1.0 (see the README there).

    python scripts/make_images.py
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "ctxpatch_lite" / "data" / "images"
SIZE = 224


def _canvas():
    fig = plt.figure(figsize=(SIZE / 100, SIZE / 100), dpi=100)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    return fig, ax


def mars_sunset():
    """A sunset on Mars: a dusty butterscotch sky fading to blue around a small pale sun, dunes in the foreground."""
    fig, ax = _canvas()
    y = np.linspace(0, 1, 200)[:, None]
    sky = np.concatenate([0.85 - 0.45 * y, 0.55 - 0.25 * y, 0.35 + 0.35 * (y ** 2)], axis=1)[:, None, :]
    ax.imshow(np.repeat(sky, 2, axis=1), extent=(0, 1, 0, 1), origin="lower", aspect="auto")
    ax.add_patch(plt.Circle((0.62, 0.42), 0.05, color="#e8f0ff", zorder=2))
    ax.add_patch(plt.Circle((0.62, 0.42), 0.11, color="#bcd4f5", alpha=0.35, zorder=1))
    x = np.linspace(0, 1, 300)
    for k, (base, amp, col) in enumerate([(0.33, 0.05, "#a0522d"), (0.22, 0.07, "#8b3a1a"), (0.1, 0.06, "#5c2410")]):
        ax.fill_between(x, 0, base + amp * np.sin(6 * x + 1.7 * k) + 0.02 * np.sin(23 * x + k), color=col, zorder=3 + k)
    return fig


def robot():
    """A slightly annoyed robot: a grey box head with one raised eyebrow, an antenna and a flat mouth."""
    fig, ax = _canvas()
    ax.add_patch(plt.Rectangle((0, 0), 1, 1, color="#f3e9d2"))
    ax.add_patch(plt.Rectangle((0.25, 0.2), 0.5, 0.5, color="#7d8590", ec="#2f343a", lw=3))
    ax.plot([0.5, 0.5], [0.7, 0.85], color="#2f343a", lw=3)
    ax.add_patch(plt.Circle((0.5, 0.87), 0.035, color="#d9534f"))
    for cx in (0.38, 0.62):
        ax.add_patch(plt.Circle((cx, 0.52), 0.06, color="#fdfdfd", ec="#2f343a", lw=2))
        ax.add_patch(plt.Circle((cx, 0.52), 0.025, color="#1f6fb2"))
    ax.plot([0.31, 0.45], [0.62, 0.66], color="#2f343a", lw=3)          # the raised eyebrow
    ax.plot([0.55, 0.69], [0.63, 0.63], color="#2f343a", lw=3)
    ax.plot([0.38, 0.62], [0.33, 0.33], color="#2f343a", lw=4)          # a flat mouth
    return fig


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, draw in (("mars_sunset", mars_sunset), ("robot", robot)):
        fig = draw()
        fig.savefig(OUT / f"{name}.png", dpi=100, metadata={"Software": None})
        plt.close(fig)
        print("wrote", OUT / f"{name}.png")


if __name__ == "__main__":
    main()
