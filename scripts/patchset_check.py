"""Every PatchSet form against the full-context logits, on the five paper prompts (the embedded model).

    .venv/bin/python scripts/patchset_check.py [--dtype float32] [--variant naive] [--threads 1] [--json OUT]

Prints, per prompt, L_inf(patched - full context) for ``applied`` (factored), ``merge_into`` (materialized) and the
saved-and-reloaded peft adapter, and whether a saved-and-reloaded PatchSet gives bit-identical logits.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import ctxpatch_lite as cp
from ctxpatch_lite.algorithm import Algorithm1, PatchConfig
from ctxpatch_lite.patchset import unload_peft
from ctxpatch_lite.views import load_prompts


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variant", default="naive")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peft import PeftModel

    model, tok = cp.load_model(dtype=args.dtype, device="cpu", progress=False)
    rows, tmp = [], Path(tempfile.mkdtemp())
    print(f"{'prompt':<10}{'applied':>11}{'merged':>11}{'peft':>11}{'unpatched':>11}  reload bit-identical")
    for p in load_prompts():
        ps = cp.absorb(model, p["text"], tokenizer=tok, config=PatchConfig(variant=args.variant))
        q = lambda m: m(input_ids=torch.tensor([[ps.query_id]]), position_ids=torch.tensor([[ps.position]])).logits[0, -1]  # noqa: E731
        base = Algorithm1(model).full_context(ps.context_ids)[0]
        unpatched = q(model)
        with ps.applied(model):
            applied = q(model)
        restore = ps.merge_into(model)
        merged = q(model)
        restore()
        ps.to_peft(tmp / p["id"], model)
        pm = PeftModel.from_pretrained(model, str(tmp / p["id"]))
        lora = q(pm)
        unload_peft(pm)
        ps.save(tmp / f"{p['id']}.patch")
        with cp.PatchSet.load(tmp / f"{p['id']}.patch", model=model).applied(model):
            same = torch.equal(q(model), applied)
        d = lambda x: float((x.double() - base.double()).abs().max())  # noqa: E731
        row = {"prompt": p["id"], "applied": d(applied), "merged": d(merged), "peft": d(lora),
               "unpatched": d(unpatched), "reload_bit_identical": same}
        rows.append(row)
        print(f"{p['id']:<10}{row['applied']:>11.2e}{row['merged']:>11.2e}{row['peft']:>11.2e}{row['unpatched']:>11.2e}"
              f"  {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "variant": args.variant, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
