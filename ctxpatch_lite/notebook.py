"""Small helpers the notebooks share: metrics JSON for the runner, figure saving, and a quiet, steady setup."""
from __future__ import annotations

import json
import os
from pathlib import Path


def setup(threads: int | None = None, quiet: bool = True) -> None:
    """Quiet transformers' progress bars/warnings; optionally pin torch threads (the runner passes its choice)."""
    import torch
    from transformers.utils import logging as hf_logging

    if threads is None and os.environ.get("CTXPATCH_THREADS"):
        threads = int(os.environ["CTXPATCH_THREADS"])
    if threads:
        torch.set_num_threads(threads)
    if quiet:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def save_metrics(path: str | None, metrics: dict) -> None:
    """Write a notebook's metrics JSON where the runner asked for it (``metrics_out`` parameter); no-op if None."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(metrics, indent=1, default=float))


def save_figure(fig, name: str, figures_dir: str | None) -> None:
    """Save ``fig`` as ``<figures_dir>/<name>.png`` when the runner gave a folder; no-op otherwise."""
    if figures_dir:
        Path(figures_dir).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(figures_dir) / f"{name}.png", dpi=110, bbox_inches="tight")
