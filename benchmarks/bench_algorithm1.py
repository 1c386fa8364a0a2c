"""Benchmark Algorithm 1 against plain KV-cached decoding.

    .venv/bin/python benchmarks/bench_algorithm1.py [--tokens 20] [--prompts 1] [--dtype float32]
                                                    [--threads 1] [--model NAME] [--json OUT]

Per generated token, on the same machine, threads and model: a KV-cached greedy decode step; step-by-step
Algorithm 1 (one KV-cached full-context step for the targets + one patched query-alone pass), with factored and
with materialized patches; and batched teacher-forced Algorithm 1 (given the baseline trajectory: one
full-context forward over the sequence + one batched query-alone pass). Metrics (TVD, ranks, ...) are not timed.
Also: agreement of batched and step-by-step patched logits, and peak extra resident memory of each method
(Linux VmHWM, reset before each method) against the model's parameter size.

Also: the floor of the batched path on this machine (its matrix products alone: every linear map of the decoder
layers on the full-context rows plus the query rows, and the output head on both sets of rows, timed as bare
``F.linear`` calls), and the host transfers per generated token (``hostsync.count_host_syncs``: item, tolist, numpy,
cpu, float, int, bool of a tensor) of the paper's protocol (``run_protocol``), step by step and batched, naive and
stable, split into the package's own code and everything else (transformers).

On CUDA, times come from CUDA events after a warm-up, and ``torch.cuda.max_memory_allocated`` is reported.
Torch on a 2-core machine can fall into a slow thread state; timings pin torch threads (default 1) and say so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_peak():
    """Reset the process's peak RSS (VmHWM) so the next method's peak can be measured (Linux only)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(fn, repeats: int = 1, cuda: bool = False):
    """Run ``fn`` ``repeats`` times; return (best seconds, peak extra memory in MB during the runs, last result).
    CPU: wall clock and Linux VmHWM; CUDA: CUDA events (after the caller's warm-up) and max_memory_allocated."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        can_reset = reset_peak()
        base = _status_kb("VmRSS")
    best, out = float("inf"), None
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        peak = (_status_kb("VmHWM") - base) / 1024 if can_reset else float("nan")
    return best, peak, out


@torch.no_grad()
def batched_floor(model, n_context: int, n_rows: int, repeats: int = 2) -> float:
    """Seconds of the batched path's matrix products alone: each decoder-layer linear map on the full-context rows
    and on the query rows, the output head on both sets of rows (attention products, norms and hooks left out)."""
    from ctxpatch_lite.families import find_layers

    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    shapes = []
    for layer in find_layers(model):
        for mod in layer.modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, torch.nn.Linear) or (w is not None and w.dim() == 2 and type(mod).__name__ == "Conv1D"):
                shapes.append(w if isinstance(mod, torch.nn.Linear) else w.t())
    head = model.get_output_embeddings().weight

    def run():
        for w in shapes:
            torch.nn.functional.linear(torch.randn(n_context, w.shape[1], device=dev, dtype=dt), w)
            torch.nn.functional.linear(torch.randn(n_rows, w.shape[1], device=dev, dtype=dt), w)
        torch.nn.functional.linear(torch.randn(2 * n_rows, head.shape[1], device=dev, dtype=dt), head)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    run()
    return min(_timed(run) for _ in range(repeats))


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def host_syncs(model, prompt_ids: list, n: int) -> dict:
    """Host transfers per generated token of run_protocol, by path and variant (after one warm-up run each)."""
    from ctxpatch_lite.algorithm import PatchConfig
    from ctxpatch_lite.hostsync import count_host_syncs
    from ctxpatch_lite.protocol import run_protocol

    out = {}
    for batched in (False, True):
        for variant in ("naive", "stable"):
            cfg = PatchConfig(variant=variant)
            run_protocol(model, prompt_ids=prompt_ids, n_tokens=2, config=cfg, progress=False, batched=batched)
            with count_host_syncs() as c:
                run_protocol(model, prompt_ids=prompt_ids, n_tokens=n, config=cfg, progress=False, batched=batched)
            out[f"{'batched' if batched else 'loop'}_{variant}"] = {"package": c["package"] / n,
                                                                     "all": c["total"] / n}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=1, help="how many of data/prompts.json to run (1-5)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the timings (default 1)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per method")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from ctxpatch_lite import load_model
    from ctxpatch_lite.algorithm import Algorithm1, PatchConfig
    from ctxpatch_lite.protocol import greedy_baseline
    from ctxpatch_lite.views import load_prompts

    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, progress=False)
    dev = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
    prompts = load_prompts()[: args.prompts]
    n = args.tokens
    rows = {k: {"seconds": 0.0, "peak_mb": 0.0} for k in ("decode", "loop_factored", "loop_materialized", "batched")}
    agree, max_diff = [], 0.0
    cuda = dev.type == "cuda"
    for p in prompts:
        ids = tok(p["text"])["input_ids"]

        def decode():
            out = greedy_baseline(model, ids, n)
            sync()
            return out

        def loop(apply):
            def run():
                alg = Algorithm1(model, PatchConfig(apply=apply))
                seq, qs = list(ids), []
                logits, targets, cache = alg.full_context(seq)
                for step in range(n):
                    q, _ = alg.patched(seq[-1], len(seq) - 1, targets)
                    qs.append(q)
                    seq.append(int(logits.argmax()))
                    if step < n - 1:
                        logits, targets, cache = alg.full_context([seq[-1]], cache)
                sync()
                return torch.stack(qs)
            return run

        gen = greedy_baseline(model, ids, n)
        seq = ids + gen[:-1]
        positions = list(range(len(ids) - 1, len(seq)))

        def batched():
            out = Algorithm1(model, PatchConfig()).batched(seq, positions)[1]
            sync()
            return out

        for key, fn in (("decode", decode), ("loop_factored", loop("factored")),
                        ("loop_materialized", loop("materialized")), ("batched", batched)):
            if cuda:
                fn()                                  # warm-up: kernels, handles, allocator
            secs, peak, out = measure(fn, args.repeats, cuda)
            rows[key]["seconds"] += secs
            rows[key]["peak_mb"] = max(rows[key]["peak_mb"], peak)
            if key == "loop_factored":
                loop_logits = out
            if key == "batched":
                a, b = out.double(), loop_logits.double()
                agree += (a.argmax(-1) == b.argmax(-1)).tolist()
                max_diff = max(max_diff, float((a - b).abs().max()))
    total = n * len(prompts)
    per_token = {k: v["seconds"] / total for k, v in rows.items()}
    first = tok(prompts[0]["text"])["input_ids"]
    floor = batched_floor(model, len(first) + n - 1, n) / n
    syncs = host_syncs(model, first, n)
    result = {
        "ratio_step_over_decode": per_token["loop_factored"] / per_token["decode"],
        "ratio_loop_over_batched": per_token["loop_factored"] / per_token["batched"],
        "batched_floor_seconds_per_token": floor,
        "ratio_loop_over_batched_floor": per_token["loop_factored"] / floor,
        "host_syncs_per_token": syncs,
        "batched_argmax_agreement": sum(agree) / len(agree),
        "batched_max_logit_diff": max_diff,
        "peak_extra_memory_mb": rows["loop_factored"]["peak_mb"],
        "peak_extra_memory_mb_by_method": {k: v["peak_mb"] for k, v in rows.items()},
        "model_parameter_mb": model_mb,
        "per_token_seconds": per_token,
        "tokens": n, "prompts": len(prompts), "compared_tokens": len(agree),
        "dtype": args.dtype, "model": getattr(model, "ctxpatch_source", args.model), "device": str(dev),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "repeats": args.repeats,
        "targets": {"ratio_step_over_decode": "<= 2.5", "ratio_loop_over_batched": ">= 8",
                    "host_syncs_per_token (package)": "<= 5",
                    "batched_argmax_agreement": "1.0", "batched_max_logit_diff": "<= 1e-3 (float32)"},
    }
    print(f"model {result['model']} ({model_mb:.0f} MB of parameters), {args.dtype}, device {dev}, "
          f"torch threads {result['torch_threads']}, {len(prompts)} prompt(s) x {n} tokens, best of {args.repeats}")
    print(f"{'method':<34}{'ms / token':>12}{'x decode':>10}{'peak extra MB':>15}")
    names = {"decode": "KV-cached greedy decode step", "loop_factored": "Algorithm 1 step by step, factored",
             "loop_materialized": "Algorithm 1 step by step, materialized", "batched": "Algorithm 1 batched (teacher-forced)"}
    for k, label in names.items():
        print(f"{label:<34}{1000 * per_token[k]:>12.1f}{per_token[k] / per_token['decode']:>10.2f}"
              f"{rows[k]['peak_mb']:>15.1f}")
    print(f"{'batched floor (matrix products only)':<34}{1000 * floor:>12.1f}{floor / per_token['decode']:>10.2f}")
    print(f"ratio step/decode {result['ratio_step_over_decode']:.2f} (target <= 2.5); loop/batched "
          f"{result['ratio_loop_over_batched']:.2f} (target >= 8; loop/floor {result['ratio_loop_over_batched_floor']:.2f}); "
          f"batched vs loop: argmax agreement "
          f"{result['batched_argmax_agreement']:.3f} over {len(agree)} steps, max logit diff {max_diff:.2e}")
    print(f"{'host transfers per token':<26}{'package':>9}{'all':>7}")
    for k, v in syncs.items():
        print(f"{k:<26}{v['package']:>9.2f}{v['all']:>7.2f}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json_out}")
    return result


if __name__ == "__main__":
    main()
