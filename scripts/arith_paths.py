"""Which arithmetic-path variables move which numbers, on this machine.

    .venv/bin/python scripts/arith_paths.py [--out benchmarks/results/arith_paths.json]

A CPU's libraries pick their kernels by the vector width the CPU offers (AVX-512, AVX2, SSE), and each width sums
in another order, so the last bits of a float32 result, and the last bit of a bfloat16 one, depend on the machine.
Three libraries decide it in torch's CPU build, each with its own variable, read when the process starts:

* ``ATEN_CPU_CAPABILITY`` (default | avx2 | avx512): ATen's own vectorised kernels (softmax, norms, reductions,
  elementwise maths);
* ``MKL_CBWR`` (COMPATIBLE | AVX2 | AVX512 ...): MKL's code path for float32/float64 matrix products;
* ``ONEDNN_MAX_CPU_ISA`` (SSE41 | AVX2 | AVX512_CORE ...): oneDNN's, which runs the bfloat16 matrix products.

Each setting (one variable at a time, then the combinations that imitate another machine) runs the same probes in
a fresh process: a float32 and a float64 matrix product, a bfloat16 one, a softmax and an RMS normalisation, and
the embedded Gemma 3 270M's logits for one prompt in float32 and bfloat16. The table says, per probe, whether the
result is bit-identical to this machine's default and the largest difference. It prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One variable at a time, then whole machines imitated: this one's AVX2 sibling and the plainest x86-64 path.
SETTINGS = {
    "default": {},
    "ATEN=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATEN=default": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "ONEDNN=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ONEDNN=SSE41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2 machine": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "sse machine": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}

PROBE = r"""
import json, sys, torch
torch.set_num_threads(1)
out = {"capability": torch.backends.cpu.get_cpu_capability()}
import numpy as np
rng = np.random.default_rng(0)          # inputs from numpy: torch.randn itself is vectorised, so it moves with ATen
a, b = (torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) for s in ((256, 640), (640, 2048)))
x = torch.from_numpy(rng.standard_normal((8, 262144), dtype=np.float32)) * 8
res = {"randn float32 (seeded torch generator)": torch.randn(4096, generator=torch.Generator().manual_seed(0)),
       "matmul float32": a @ b, "matmul float64": a.double() @ b.double(),
       "matmul bfloat16": (a.bfloat16() @ b.bfloat16()).float(),
       "softmax float32": torch.softmax(x, -1), "rms norm float32": a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)}
if len(sys.argv) > 1:
    from ctxpatch_lite import load_model
    for dt in ("float32", "bfloat16"):
        model, tok = load_model(dtype=dt, device="cpu", progress=False)
        ids = tok("Write a single-sentence weather forecast for Mars, from the perspective of a slightly annoyed robot:",
                  return_tensors="pt")
        with torch.no_grad():
            res[f"Gemma 3 270M logits {dt}"] = model(**ids, logits_to_keep=1).logits[0, -1].float()
        del model
torch.save(res, sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
print(json.dumps(out))
"""


def run(setting: dict, path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    env.update(setting)
    r = subprocess.run([sys.executable, "-c", PROBE, str(path)], env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"probe failed under {setting}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "arith_paths.json"))
    ap.add_argument("--tmp", default="/tmp/ctxpatch-arith")
    args = ap.parse_args(argv)
    import torch
    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    results, info = {}, {}
    for name, setting in SETTINGS.items():
        t0 = time.time()
        info[name] = {**run(setting, tmp / f"{name}.pt"), "env": setting, "seconds": round(time.time() - t0, 1)}
        results[name] = torch.load(tmp / f"{name}.pt")
    base = results["default"]
    table = {}
    for name, res in results.items():
        table[name] = {}
        for probe, t in res.items():
            ref = base[probe]
            diff = float((t.double() - ref.double()).abs().max())
            table[name][probe] = {"identical": bool(torch.equal(t, ref)), "max_abs_diff": diff,
                                  "max_rel_diff": diff / float(ref.abs().max())}
    probes = list(base)
    print(f"{'setting':<16}{'capability':<12}" + "".join(f"{p[:22]:>24}" for p in probes))
    for name in results:
        cells = "".join(f"{'same' if c['identical'] else format(c['max_abs_diff'], '.2e'):>24}"
                        for c in table[name].values())
        print(f"{name:<16}{info[name]['capability']:<12}{cells}")
    import platform
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "measured": time.strftime("%Y-%m-%d"), "command": "scripts/arith_paths.py",
        "machine": {"processor": platform.processor() or platform.machine(),
                    "default_capability": info["default"]["capability"], "torch": torch.__version__},
        "settings": info, "max_abs_diff_vs_default": table}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
