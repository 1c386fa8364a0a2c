"""Regression runs of Algorithm 1 under the paper's protocol.

    python -m ctxpatch_lite.compare --prompt "..." --tokens 20 --dtype float32 --variant naive --json out.json

``--paper-prompt ID|all`` runs the paper's prompts (shipped with the package); ``--prompt-file`` takes a text file
(one prompt) or a JSON list / ``prompts.json``-style file. With several prompts every one is run; the JSON then
holds one record per prompt under ``runs`` plus the pooled summary. Bad arguments exit
with status 2 and one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .algorithm import LEGACY_MODES, PARTS, SCHEDULES, PatchConfig, from_legacy_mode
from .engine import APPLY_MODES, H_SOURCES, VARIANTS
from .hooks import PatchError, UnsupportedArchitectureError
from .metrics import format_fraction
from .models import DTYPES, ModelLoadError


def read_prompts(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    text = p.read_text()
    if p.suffix == ".json":
        data = json.loads(text)
        items = data["prompts"] if isinstance(data, dict) else data
        return [{"id": it.get("id", f"p{i}"), "text": it["text"]} if isinstance(it, dict) else
                {"id": f"p{i}", "text": str(it)} for i, it in enumerate(items)]
    return [{"id": p.stem, "text": text.strip()}]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ctxpatch_lite.compare", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text (its last token is the first query)")
    src.add_argument("--prompt-file", help="a .txt file with one prompt, or a .json list of prompts")
    src.add_argument("--paper-prompt", help="one of the paper's prompts by id (mars, lipogram, bug, haiku, couplet), "
                                            "or 'all' for the five")
    ap.add_argument("--image", action="append", default=None, metavar="PATH",
                    help="an image in the context (repeat for several; a multimodal model such as "
                         "google/gemma-3-4b-it): each goes where the prompt holds the image placeholder "
                         "(<start_of_image>); one is put before the prompt's text if it holds none")
    ap.add_argument("--tokens", type=int, default=20, help="generated tokens per prompt (default 20)")
    ap.add_argument("--dtype", default="float32", help=f"model dtype: {', '.join(DTYPES)}")
    ap.add_argument("--patch-dtype", default=None, help="dtype the patches are built in (default: float32, or "
                                                        "float64 for float64 models)")
    ap.add_argument("--variant", default="naive", help=f"{' | '.join(VARIANTS)}")
    ap.add_argument("--start-layer", default="0", help="first patched layer: an index (0-based; negative counts from "
                                                      "the end), 'last', or a fraction of depth such as 0.5")
    ap.add_argument("--apply", default="factored", help=f"{' | '.join(APPLY_MODES)}")
    ap.add_argument("--h-source", default="actual", help=f"{' | '.join(H_SOURCES)}")
    ap.add_argument("--schedule", default=None, help=f"{' | '.join(SCHEDULES)} (default selfcorrect)")
    ap.add_argument("--parts", default=None, help=f"{' | '.join(PARTS)} (default full)")
    ap.add_argument("--mode", default=None, help=f"first-edition name, mapped onto --schedule/--parts: "
                                                 f"{' | '.join(LEGACY_MODES)} (its ideal is now --schedule oracle)")
    ap.add_argument("--model", default=None, help="hub id or local folder (default: the embedded Gemma 3 270M)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--chat-template", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--batched", action="store_true", help="batched teacher-forced path (factored patches; not for "
                                                           "--mode fixed)")
    ap.add_argument("--free", action="store_true", help="free-running: the patched model picks its own next token "
                                                        "(the record gives the step where its text leaves the "
                                                        "baseline's greedy text)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (e.g. 1 for steady timings on 2 cores)")
    ap.add_argument("--json", dest="json_out", default=None, help="write the full record to this JSON file")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--no-per-layer", action="store_true", help="drop the per-layer diagnostics from the JSON "
                                                                "(keeps a long grid's files small)")
    return ap


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


class ArgumentError(ValueError):
    """A bad command line (the sweep's grid validation catches it instead of exiting)."""


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as the CLI reads it, raising ``ArgumentError`` instead of printing usage and exiting."""
    ap = parser()

    def error(message):
        raise ArgumentError(message)
    ap.error = error
    return ap.parse_args(argv)


def prepare(args: argparse.Namespace) -> tuple[PatchConfig, list[dict]]:
    """The run's ``PatchConfig`` and prompts from parsed options; ``ValueError`` with one line for bad ones."""
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {args.dtype!r}; choose one of: {', '.join(DTYPES)}")
    if args.tokens < 1:
        raise ValueError(f"--tokens must be at least 1, got {args.tokens}")
    try:
        schedule, parts = args.schedule or "selfcorrect", args.parts or "full"
        if args.mode is not None:
            if args.schedule or args.parts:
                raise ValueError("--mode is the first-edition name of a --schedule/--parts pair; give one or the other")
            schedule, parts = from_legacy_mode(args.mode)
            print(f"note: --mode {args.mode} runs as --schedule {schedule} --parts {parts}"
                  + (" (the first edition's 'ideal' fed each layer its recorded input: an oracle)"
                     if args.mode == "ideal" else ""), file=sys.stderr)
        config = PatchConfig(variant=args.variant, start_layer=args.start_layer, h_source=args.h_source,
                             apply=args.apply, schedule=schedule, parts=parts, patch_dtype=args.patch_dtype)
        config.validate(n_layers=10 ** 9)  # names first; the layer range is checked once the model is known
        if args.paper_prompt:
            from .prompts import load_prompts, paper_prompt
            prompts = load_prompts() if args.paper_prompt == "all" else [paper_prompt(args.paper_prompt)]
        elif args.prompt_file:
            prompts = read_prompts(args.prompt_file)
        else:
            prompts = [{"id": "prompt", "text": args.prompt}]
        if not prompts or any(not str(p["text"]).strip() for p in prompts):
            raise ValueError("the prompt is empty; pass some text via --prompt or --prompt-file")
        if args.image:
            missing = [i for i in args.image if not Path(i).is_file()]
            if missing:
                raise ValueError(f"--image {missing[0]}: no such file")
    except KeyError as exc:
        raise ValueError(str(exc).strip("'\"")) from None
    return config, prompts


def execute(args: argparse.Namespace, config: PatchConfig, prompts: list[dict], model=None, tokenizer=None) -> dict:
    """Run every prompt and return the record ``--json`` writes (one prompt: its run; several: pooled, with
    ``runs``). ``model``/``tokenizer`` skip loading (the sweep's workers keep a model between jobs). Errors a user
    can fix raise ``ModelLoadError``, ``UnsupportedArchitectureError``, ``PromptError``, ``PatchError`` or
    ``ValueError``."""
    from .algorithm import Algorithm1
    from .protocol import run_protocol, summarize

    if model is None:
        from .models import load_model
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, progress=not args.quiet)
    Algorithm1(model, config)  # validates the architecture and the start layer against this model
    runs = []
    for p in prompts:
        text = p["text"]
        if args.image:
            marker = getattr(getattr(tokenizer, "tokenizer", None), "boi_token", None)
            if marker and marker not in text:
                text = " ".join([marker] * len(args.image)) + " " + text
        rec = run_protocol(model, tokenizer, text, args.tokens, config, chat_template=args.chat_template,
                           progress=not args.quiet, desc=p["id"], batched=args.batched,
                           forcing="patched" if args.free else "baseline", images=args.image)
        rec["prompt_id"] = p["id"]
        if args.no_per_layer:
            for s in rec["steps"]:
                s["diagnostics"].pop("per_layer", None)
        runs.append(rec)
    steps = [s for r in runs for s in r["steps"]]
    pooled = summarize(steps)
    out = runs[0] if len(runs) == 1 else {
        "n_tokens": pooled["n_tokens"], "token_match": pooled["token_match"],
        "linf": [s["linf"] for s in steps], "tvd": [s["tvd"] for s in steps], "steps": steps,
        "summary": pooled, "config": runs[0]["config"], "runs": runs,
    }
    out["config"] = {**out["config"], "chat_template": bool(args.chat_template), "command": sys.argv[:]}
    return out


def print_table(out: dict, config: PatchConfig, dtype: str) -> None:
    """The per-prompt table the CLI prints."""
    runs = out.get("runs") or [out]
    print(f"model {out['config']['model']}  dtype {dtype}  variant {config.variant}  "
          f"schedule {config.schedule}  parts {config.parts}  "
          f"apply {config.apply}  h_source {config.h_source}  start_layer {config.start_layer}")
    print(f"{'prompt':<12}{'tokens':>7}  {'token match':<18}{'median Linf':>12}{'max Linf':>11}{'median TVD':>12}"
          f"{'fallbacks':>10}{'hard':>6}")
    for r in runs + ([{"prompt_id": "ALL", "summary": out["summary"]}] if len(runs) > 1 else []):
        s = r["summary"]
        print(f"{r['prompt_id']:<12}{s['n_tokens']:>7}  {format_fraction(s['n_match'], s['n_tokens']):<18}"
              f"{s['linf_median']:>12.3e}{s['linf_max']:>11.3e}{s['tvd_median']:>12.3e}"
              f"{s['fallbacks_total']:>10}{s['hard_cases_total']:>6}")
        if r.get("free"):
            f = r["free"]
            print(f"{'':<12}free-running: identical to the baseline's greedy text for {f['identical_prefix']} of "
                  f"{f['n_tokens']} tokens")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        config, prompts = prepare(args)
    except ValueError as exc:
        return _fail(str(exc))
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    from .protocol import PromptError
    try:
        out = execute(args, config, prompts)
    except (ModelLoadError, UnsupportedArchitectureError, PromptError, PatchError, ValueError) as exc:
        return _fail(str(exc))
    print_table(out, config, args.dtype)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json_out}")
    return 0


def cli() -> None:
    """Console-script entry point (``pyproject.toml`` [project.scripts])."""
    from ._optional import run_cli
    run_cli(main)


if __name__ == "__main__":
    cli()
