"""The one-shot GPU check behind scripts/gpu_check.sh: library versions, ``pytest -m cuda``, and Algorithm 1 timed on
a random-weight Gemma-3-1B-shaped model built from its configuration (no download, no tokenizer: seeded token ids),
in bfloat16 and float32, with CUDA events after a warm-up, max_memory_allocated and host transfers per token.
Writes one JSON. On a machine without CUDA it says so, runs the CPU parts on a small model, and exits 0.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "torch_cuda": torch.version.cuda}
    for name in ("transformers", "accelerate", "peft", "safetensors", "numpy", "pandas", "pytest"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def build_model(dtype: torch.dtype, device: str, layers: int | None = None):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from ctxpatch_lite.fixtures import GEMMA3_1B
    cfg = dict(GEMMA3_1B)
    if layers:          # the CPU fallback: the same shape, fewer layers and a small vocabulary
        cfg.update(num_hidden_layers=layers, layer_types=cfg["layer_types"][:layers], vocab_size=4096)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
    model.ctxpatch_source = f"random Gemma-3-1B-shaped ({cfg['num_hidden_layers']} layers)"
    return model.eval().requires_grad_(False)


def bench(model, n: int, repeats: int) -> dict:
    from bench_algorithm1 import batched_floor, host_syncs, measure

    from ctxpatch_lite.algorithm import Algorithm1, PatchConfig
    from ctxpatch_lite.protocol import greedy_baseline, run_protocol

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def loop():
        alg = Algorithm1(model, PatchConfig())
        seq = list(ids)
        logits, targets, cache = alg.full_context(seq)
        for step in range(n):
            alg.patched(seq[-1], len(seq) - 1, targets)
            seq.append(int(logits.argmax()))
            if step < n - 1:
                logits, targets, cache = alg.full_context([seq[-1]], cache)
        sync()

    gen = greedy_baseline(model, ids, n)
    seq, positions = ids + gen[:-1], list(range(len(ids) - 1, len(ids) + n - 1))
    methods = {"decode": lambda: (greedy_baseline(model, ids, n), sync()),
               "loop_factored": loop,
               "batched": lambda: (Algorithm1(model, PatchConfig()).batched(seq, positions), sync())}
    out, phase_s, t = {}, {}, time.time()

    def lap(name):
        nonlocal t
        phase_s[name] = round(time.time() - t, 1)
        t = time.time()
        print(f"[gpu_check]   {name}: {phase_s[name]} s", flush=True)

    for name, fn in methods.items():
        fn()                                                  # warm-up
        secs, peak, _ = measure(fn, repeats, cuda)
        out[name] = {"ms_per_token": 1000 * secs / n, "peak_extra_mb": peak}
        lap(name)
    out["batched_floor_ms_per_token"] = 1000 * batched_floor(model, len(seq), n) / n
    lap("batched_floor")
    out["host_syncs_per_token"] = host_syncs(model, ids, n)
    lap("host_syncs")
    r = run_protocol(model, prompt_ids=ids, n_tokens=n, progress=False, batched=True,
                     config=PatchConfig(variant="stable" if model.dtype == torch.bfloat16 else "naive"))
    out["protocol"] = {"token_match": f"{r['summary']['n_match']}/{r['n_tokens']}",
                       "linf_median": r["summary"]["linf_median"], "precision_flags": r["config"]["precision_flags"]}
    lap("protocol")
    out["phase_seconds"] = phase_s
    if cuda:
        out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated, of bfloat16,float32")
    ap.add_argument("--skip-pytest", action="store_true", help="leave out pytest -m cuda")
    args = ap.parse_args(argv)
    t0 = time.time()
    result = {"versions": versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    cuda = torch.cuda.is_available()
    print(f"[gpu_check] {json.dumps(result['versions'])}", flush=True)
    from ctxpatch_lite._optional import version_warnings
    result["version_warnings"] = version_warnings()
    for text in result["version_warnings"]:
        print(f"[gpu_check] WARNING: {text}", flush=True)
    if not cuda:
        print("[gpu_check] CUDA is absent: running the CPU parts only (cuda tests skip; a 2-layer model of the "
              "1B shape for the benchmark)", flush=True)
    rc = 0
    if not args.skip_pytest:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_cuda.py"), str(ROOT / "tests" / "test_precision.py")],
                           capture_output=True, text=True, cwd=ROOT)
        rc = r.returncode
        result["pytest_cuda"] = {"returncode": r.returncode, "tail": r.stdout.strip().splitlines()[-12:]}
        print("[gpu_check] pytest -m cuda:\n  " + "\n  ".join(result["pytest_cuda"]["tail"]), flush=True)
    device = "cuda" if cuda else "cpu"
    for key in args.dtypes.split(","):
        dtype = getattr(torch, key)
        t0b = time.time()
        model = build_model(dtype, device, layers=None if cuda else 2)
        print(f"[gpu_check] {key}: model built in {time.time() - t0b:.1f} s", flush=True)
        result[f"bench_{key}"] = bench(model, args.tokens if cuda else 4, args.repeats if cuda else 1)
        print(f"[gpu_check] {key}: {json.dumps(result[f'bench_{key}'])}", flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    result["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"[gpu_check] wrote {args.out} in {result['seconds']} s")
    return 0 if (rc in (0, 5) or not cuda) else 1


if __name__ == "__main__":
    sys.exit(main())
