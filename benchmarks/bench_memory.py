"""Peak resident memory and time of a notebook-sized run, with and without ``notebook.low_memory()``.

    .venv/bin/python benchmarks/bench_memory.py [--tokens 20] [--threads 1] [--json OUT]

Each setting runs in a fresh process (peak resident memory is per process): load the embedded Gemma 3 270M in
float32, run the paper's protocol on the Mars prompt batched (teacher-forced) and step by step, free the model,
load the bfloat16 copy and run it batched, as notebooks 03-05 do. Reported: seconds of each run, and resident
memory (VmRSS, VmHWM = the peak so far, split into anonymous and file-backed pages) after each stage. Prints a
table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from ctxpatch_lite.notebook import free_memory, low_memory
active = low_memory() if sys.argv[1] == "on" else False
import ctxpatch_lite as cp
from ctxpatch_lite.algorithm import PatchConfig
from ctxpatch_lite.prompts import paper_prompt
from ctxpatch_lite.protocol import run_protocol

def mem():
    d = {}
    for line in open("/proc/self/status"):
        p = line.split()
        if len(p) > 1 and p[0].rstrip(":") in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            d[p[0].rstrip(":")] = round(int(p[1]) * 1024 / 1e9, 3)
    return d

out = {"low_memory": active, "stages": []}
tokens, text = int(sys.argv[3]), paper_prompt("mars")["text"]
model, tok = cp.load_model(progress=False)
out["stages"].append(("float32 loaded", None, mem()))
for name, kw in (("float32 batched", dict(batched=True)), ("float32 step by step", {})):
    t0 = time.perf_counter()
    run_protocol(model, tok, text, tokens, PatchConfig(), progress=False, **kw)
    out["stages"].append((name, round(time.perf_counter() - t0, 2), mem()))
del model
free_memory()
out["stages"].append(("float32 freed", None, mem()))
model = cp.load_model(dtype="bfloat16", progress=False, tokenizer=False)[0]
t0 = time.perf_counter()
run_protocol(model, tok, text, tokens, PatchConfig(), progress=False, batched=True)
out["stages"].append(("bfloat16 batched", round(time.perf_counter() - t0, 2), mem()))
print("RESULT" + json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = {}
    for setting in ("off", "on"):
        r = subprocess.run([sys.executable, "-c", CHILD, setting, str(args.threads), str(args.tokens)],
                           capture_output=True, text=True)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
        if line is None:
            print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
            return 1
        results[f"low_memory {setting}"] = json.loads(line[len("RESULT"):])
    print(f"{'setting':<16}{'stage':<22}{'seconds':>8}{'RSS GB':>8}{'peak GB':>9}{'anon GB':>9}{'file GB':>9}")
    for setting, res in results.items():
        for name, secs, m in res["stages"]:
            print(f"{setting:<16}{name:<22}{'' if secs is None else secs:>8}{m['VmRSS']:>8}{m['VmHWM']:>9}"
                  f"{m['RssAnon']:>9}{m['RssFile']:>9}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "threads": args.threads, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
