"""The output head on the rows transformers keeps, as a strided view and re-viewed (``models.standard_head_strides``).

    .venv/bin/python benchmarks/bench_head.py [--threads 1] [--repeat 3] [--json benchmarks/results/bench_head.json]

For the embedded Gemma 3 270M (head 262,144 x 640) in bfloat16 and float32: the seconds of one head call on the
last k rows of a 40-row sequence, kept as transformers keeps them (a slice whose batch stride spans the sequence)
and re-viewed with standard strides, the median of ``--repeat`` calls, and whether the logits are bit for bit equal.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/bench_head.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import ctxpatch_lite as cp

    rows = []
    for dtype in ("bfloat16", "float32"):
        model = cp.load_model(None, dtype=dtype, device="cpu", progress=False, tokenizer=False)[0]
        head = model.get_output_embeddings()
        hooks = dict(head._forward_pre_hooks)
        seq = torch.randn(1, 40, head.in_features, generator=torch.Generator().manual_seed(0)).to(head.weight.dtype)
        for k in (1, 20):
            x = seq[:, -k:]
            times, out = {}, {}
            for how in ("strided view", "re-viewed"):
                head._forward_pre_hooks.clear()
                if how == "re-viewed":
                    head._forward_pre_hooks.update(hooks)
                with torch.no_grad():
                    ts = []
                    for _ in range(a.repeat):
                        t = time.perf_counter()
                        out[how] = head(x)
                        ts.append(time.perf_counter() - t)
                times[how] = statistics.median(ts)
            head._forward_pre_hooks.update(hooks)
            rows.append({"dtype": dtype, "rows": k, "strided_s": times["strided view"], "reviewed_s": times["re-viewed"],
                         "speedup": times["strided view"] / times["re-viewed"],
                         "bit_identical": bool(torch.equal(out["strided view"], out["re-viewed"]))})
        del model
    print(f"{'dtype':<10}{'rows':>5}{'strided view (s)':>18}{'re-viewed (s)':>15}{'speed-up':>10}{'same logits':>13}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['rows']:>5}{r['strided_s']:>18.3f}{r['reviewed_s']:>15.3f}{r['speedup']:>10.1f}"
              f"{str(r['bit_identical']):>13}")
    from ctxpatch_lite.protocol import environment
    result = {"benchmark": "bench_head", "threads": a.threads, "repeat": a.repeat, "rows": rows,
              "environment": environment()}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
