"""Algorithm 1 on every supported transformers family (paper Section 5, Table 1), on seeded tiny models.

    python -m ctxpatch_lite.verify_architectures [--dtype float64] [--json OUT] [--tokens 8] [--embedded]

Prints one row per family: transformers class, block kind, input patch, output patch, the largest relative error
of a block patched alone and fed the full-context input (Theorem 1, every layer), the largest relative error of any
block in Algorithm 1 against its full-context output, Algorithm 1 token match and L_inf over the generated tokens,
fallbacks (h_i == 0), and the unpatched control. Exits 1 if a family misses its target (float64: block error
<= 1e-10 and 100% token match; other dtypes: 100% token match), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .architectures import FLOAT64_TOLERANCE, meets_target, verify_embedded, verify_family
from .families import FAMILIES
from .models import DTYPES



def passes(row) -> bool:
    """A ``FamilyRow`` meets its target (``architectures.meets_target``)."""
    return meets_target(row.to_dict())


def _cells(r) -> dict:
    return {"family": r.family, "class": r.hf_class, "block": r.block, "input patch": r.input_patch,
            "output patch": r.output_patch, "dtype": r.dtype, "single block": f"{r.single_block_rel_error:.1e}",
            "block err": f"{r.max_block_rel_error:.1e}", "match": r.token_match, "L_inf med": f"{r.linf_median:.1e}",
            "L_inf last": f"{r.linf_last:.1e}", "materialized": r.materialized_token_match,
            "batched": r.batched_token_match + ("" if r.batched_same_tokens else " (tokens differ)"),
            "stable": r.stable_token_match, "fallbacks": str(r.fallbacks), "unpatched match": r.none_token_match,
            "unpatched L_inf": f"{r.none_linf_median:.1e}", "routing": r.routing, "weights": r.weights}


ALL_COLUMNS = ("family", "class", "block", "input patch", "output patch",
               "dtype", "single block", "block err", "match", "L_inf med", "L_inf last", "materialized", "batched",
               "stable", "fallbacks", "unpatched match", "unpatched L_inf", "routing", "weights")
# what notebook 07 prints: the exactness figures (the anatomy columns are a second, per-family table)
RESULT_COLUMNS = ("family", "dtype", "single block", "block err", "match", "L_inf med", "batched", "stable",
                  "unpatched match", "unpatched L_inf")
ANATOMY_COLUMNS = ("family", "block", "input patch", "output patch")


def format_table(rows, columns=ALL_COLUMNS) -> str:
    """A fixed-width table of ``FamilyRow`` s, the named ``columns`` in order."""
    lines = [tuple(columns)] + [tuple(_cells(r)[c] for c in columns) for r in rows]
    widths = [max(len(l[i]) for l in lines) for i in range(len(columns))]
    out = ["  ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip() for l in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxpatch_lite.verify_architectures",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float64", help="float64 | float32 | bfloat16 (default float64)")
    ap.add_argument("--tokens", type=int, default=8, help="generated tokens per family (default 8)")
    ap.add_argument("--families", nargs="+", default=None, help=f"subset of: {' '.join(FAMILIES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embedded", action="store_true",
                    help="also run the generic path on the real embedded Gemma 3 270M (float32, 4 tokens)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows to this JSON file")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {args.dtype!r}; choose one of: {', '.join(DTYPES)}")
        unknown = [f for f in args.families or [] if f not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown family {unknown[0]!r}; choose from: {' '.join(FAMILIES)}")
        if args.tokens < 1:
            raise ValueError("--tokens must be at least 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [verify_family(f, dtype=args.dtype, n_tokens=args.tokens, seed=args.seed, progress=not args.quiet)
            for f in (args.families or FAMILIES)]
    if args.embedded:
        rows.append(verify_embedded(progress=not args.quiet))
    print(format_table(rows))
    failed = [r.family for r in rows if not passes(r)]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} families meet the target"
          + (f" (block error <= {FLOAT64_TOLERANCE:g} and 100% token match)" if args.dtype == "float64"
             else " (100% token match)") + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as fh:
            json.dump({"dtype": args.dtype, "tokens": args.tokens, "seed": args.seed,
                       "rows": [r.to_dict() for r in rows]}, fh, indent=1)
    return 1 if failed else 0


def cli() -> None:
    """Console-script entry point (``pyproject.toml`` [project.scripts])."""
    from ._optional import run_cli
    run_cli(main)


if __name__ == "__main__":
    cli()
