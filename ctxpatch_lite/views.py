"""Pure render functions behind the notebooks' widgets, and the widget panel that drives them.

``Algorithm1View.render(**params)`` runs Algorithm 1 under the paper's protocol for the given settings and returns
the run record, a Figure-3-style figure and a text table. Headless (papermill, nbval) the notebook calls it once
with its parameters; in JupyterLab ``Algorithm1View.app()`` adds controls that call the same function on change.
"""
from __future__ import annotations

from .algorithm import PatchConfig
from .metrics import format_fraction
from .models import load_model
from .prompts import load_prompts  # noqa: F401  (the notebooks import it from here)

GEMMA_1B = "google/gemma-3-1b-it"
EMBEDDED = "embedded"  # widget value standing for load_model(None)


def available_models() -> dict:
    """Label -> model name. Gemma-3-1B is offered only with a GPU and the weights already in the local HF cache."""
    import torch

    models = {"Gemma 3 270M (embedded, CPU)": EMBEDDED}
    if torch.cuda.is_available():
        try:
            from huggingface_hub import try_to_load_from_cache
            if isinstance(try_to_load_from_cache(GEMMA_1B, "config.json"), str):
                models["Gemma-3-1B-it (GPU)"] = GEMMA_1B
        except ImportError:  # pragma: no cover
            pass
    return models


def run_table(run: dict) -> str:
    """A short per-step table and the aggregate with its token count."""
    lines = [f"{'step':>4} {'baseline':>14} {'patched':>14} {'match':>5} {'L_inf':>10} {'TVD':>10} {'min|h|':>9}"]
    for s in run["steps"]:
        d = s["diagnostics"]
        lines.append(f"{s['step']:>4} {s.get('baseline_text', s['baseline_token'])!r:>14.14} "
                     f"{s.get('patched_text', s['patched_token'])!r:>14.14} {'yes' if s['match'] else 'NO':>5} "
                     f"{s['linf']:>10.2e} {s['tvd']:>10.2e} {d.get('min_abs_h', float('nan')):>9.1e}")
    sm = run["summary"]
    lines.append(f"token match {format_fraction(sm['n_match'], sm['n_tokens'])}; median L_inf {sm['linf_median']:.2e}"
                 f" (max {sm['linf_max']:.2e}); median TVD {sm['tvd_median']:.2e}; fallbacks "
                 f"{sm['fallbacks_total']}; App. B hard cases {sm['hard_cases_total']}")
    return "\n".join(lines)


class Algorithm1View:
    """Renders runs for the notebooks, keeping one model in memory at a time (Binder has ~2 GB of RAM).

    Switching precision or model frees the previous one before loading the next; the tokenizer is shared per
    model name.
    """

    def __init__(self, progress: bool = False):
        """``progress=False`` by default: a render takes seconds (batched path), and the progress widgets tqdm.auto
        closes when done leave dead widget views in saved notebooks and in Voila ("widget model not found")."""
        self._key, self._model, self._tokenizers = None, None, {}
        self.progress = progress

    def model(self, name, dtype):
        from .notebook import free_memory

        if self._key != (name, dtype):
            self._key, self._model = None, None
            free_memory()
            model, tok = load_model(name, dtype=dtype, progress=False, tokenizer=name not in self._tokenizers)
            if tok is not None:
                self._tokenizers[name] = tok
            self._key, self._model = (name, dtype), model
        return self._model, self._tokenizers[name]

    def run(self, prompt: str, model_name=None, dtype="float32", tokens=20, variant="naive", start_layer=0,
            apply="factored", h_source="actual", schedule="selfcorrect", parts="full", batched=None):
        """One protocol run. ``batched=None``: the batched teacher-forced path wherever it applies (factored
        patches, any schedule but ``fixed``), else step by step."""
        from .protocol import run_protocol

        model, tok = self.model(model_name, dtype)
        cfg = PatchConfig(variant=variant, start_layer=start_layer, apply=apply, h_source=h_source,
                          schedule=schedule, parts=parts)
        if batched is None:
            batched = apply == "factored" and schedule != "fixed"
        return run_protocol(model, tok, prompt, int(tokens), cfg, progress=self.progress, batched=batched,
                            desc=f"{dtype}/{variant}/start {start_layer}")

    def render(self, prompt: str, model_name=None, dtype="float32", tokens=20, variant="naive", start_layer=0,
               apply="factored", h_source="actual", schedule="selfcorrect", parts="full"):
        from . import plots

        run = self.run(prompt, model_name, dtype, tokens, variant, start_layer, apply, h_source, schedule, parts)
        label = f"{dtype}-{variant}" + (f" (start layer {start_layer})" if start_layer else "")
        fig = plots.per_token({label: run}, title=f"{label}: patched (query alone) vs baseline (full context)")
        return {"run": run, "figure": fig, "table": run_table(run)}

    def app(self, initial: dict, n_layers: int, prompts: list[dict]):
        """ipywidgets controls: precision, start layer, variant, which h the scale patch divides by (``h_source``),
        prompt (or free text), model. Returns a VBox."""
        from ._optional import require
        W = require("ipywidgets", "notebooks", "the widget panel")
        import matplotlib.pyplot as plt
        from IPython.display import display

        prompt_options = [(p["id"], p["text"]) for p in prompts] + [("free text ↓", "__free__")]
        initial_prompt = initial["prompt"] if any(p["text"] == initial["prompt"] for p in prompts) else "__free__"
        models = available_models()
        c = {
            "dtype": W.Dropdown(options=["float32", "bfloat16", "float64"], value=initial["dtype"],
                                description="precision"),
            "start_layer": W.IntSlider(value=initial["start_layer"], min=0, max=n_layers - 1,
                                       description="start layer", continuous_update=False),
            "variant": W.ToggleButtons(options=["naive", "stable"], value=initial["variant"], description="variant"),
            "h_source": W.ToggleButtons(options=["actual", "recorded"], value=initial.get("h_source", "actual"),
                                        description="h_source",
                                        tooltips=["h the patched layer computes in this pass (Theorem 1 as stated)",
                                                  "h recorded in the full-context pass"]),
            "prompt": W.Dropdown(options=prompt_options, value=initial_prompt, description="prompt"),
            "free_text": W.Text(value=initial["prompt"], description="free text", continuous_update=False,
                                layout=W.Layout(width="90%")),
            "model": W.Dropdown(options=list(models.items()), value=initial.get("model_name") or EMBEDDED,
                                description="model"),
        }
        out = W.Output()
        status = W.HTML(value="<i>change a control to rerun Algorithm 1 and redraw</i>")

        busy = []

        def follow_model(model_name):
            """The start-layer slider's range follows the loaded model (a 26-layer model after an 18-layer one)."""
            n = self.model(model_name, c["dtype"].value)[0].config.num_hidden_layers
            if c["start_layer"].max != n - 1:
                busy.append(1)          # moving the slider's range may move its value: no second rerun
                try:
                    c["start_layer"].max = n - 1
                finally:
                    busy.pop()

        def rerun(_=None):
            if busy:
                return
            prompt = c["free_text"].value if c["prompt"].value == "__free__" else c["prompt"].value
            status.value = "<b>running…</b>"
            with out:
                out.clear_output(wait=True)
                try:
                    model_name = None if c["model"].value == EMBEDDED else c["model"].value
                    follow_model(model_name)
                    res = self.render(prompt, model_name=model_name, dtype=c["dtype"].value,
                                      tokens=initial["tokens"], variant=c["variant"].value,
                                      start_layer=c["start_layer"].value, h_source=c["h_source"].value)
                except ValueError as exc:  # e.g. an empty free-text prompt: say so in the panel
                    print(f"cannot run: {exc}")
                    status.value = "<b>error</b>"
                    return
                display(res["figure"])
                plt.close(res["figure"])
                print(res["table"])
            status.value = (f"<b>done</b>: {c['dtype'].value}, {c['variant'].value}, h_source "
                            f"{c['h_source'].value}, start layer {c['start_layer'].value}")

        for w in c.values():
            w.observe(rerun, names="value")
        box = W.VBox([W.HBox([c["dtype"], c["variant"]]), c["h_source"], c["start_layer"], W.HBox([c["prompt"], c["model"]]),
                      c["free_text"], status, out])
        box.controls, box.output, box.rerun = c, out, rerun
        return box
