"""The paper's five prompts, shipped inside the package (``ctxpatch_lite/data/prompts.json``), so that a wheel
install has them: ``load_prompts()`` and ``paper_prompt("mars")``."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """``[{"id", "text", ...}]`` from ``path`` (a prompts.json-style file), by default the package's own copy."""
    if path is not None:
        return json.loads(Path(path).read_text())["prompts"]
    return json.loads(resources.files("ctxpatch_lite").joinpath("data", "prompts.json").read_text())["prompts"]


def paper_prompt(prompt_id: str) -> dict:
    """One of the paper's prompts by id; a clear error lists the ids."""
    prompts = {p["id"]: p for p in load_prompts()}
    if prompt_id not in prompts:
        raise ValueError(f"unknown paper prompt {prompt_id!r}; choose one of: {', '.join(prompts)}")
    return prompts[prompt_id]
