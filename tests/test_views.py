"""The widget panel of notebook 03: callbacks rerun Algorithm 1 and redraw (executed without a browser)."""
import pytest

from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer
from ctxpatch_lite.views import Algorithm1View, run_table


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("viewmodel")
    tiny_gemma3(seed=7).save_pretrained(f)
    tiny_tokenizer().save_pretrained(f)
    return str(f)


def test_render_returns_run_figure_table(folder):
    view = Algorithm1View(progress=False)
    res = view.render("hello there", model_name=folder, tokens=3)
    assert res["run"]["n_tokens"] == 3 and "token match" in res["table"]
    assert res["figure"].axes and res["figure"].axes[0].get_yscale() == "log"


def test_widget_callbacks_rerun_and_redraw(folder, monkeypatch):
    import ipywidgets  # noqa: F401
    import ctxpatch_lite.views as views
    monkeypatch.setattr(views, "available_models", lambda: {"tiny": folder})
    view = Algorithm1View(progress=False)
    calls = []
    real_render = view.render

    def spy(*a, **k):
        calls.append(k)
        return real_render(*a, **k)

    view.render = spy
    panel = view.app(dict(prompt="hello there", model_name=folder, dtype="float32", tokens=3, variant="naive",
                          start_layer=0), n_layers=4, prompts=[{"id": "p", "text": "hello there"}])
    c = panel.controls
    assert c["start_layer"].max == 3 and c["dtype"].options == ("float32", "bfloat16", "float64")
    c["dtype"].value = "float64"
    assert calls[-1]["dtype"] == "float64"
    c["start_layer"].value = 3
    assert calls[-1]["start_layer"] == 3 and calls[-1]["dtype"] == "float64"
    c["variant"].value = "stable"
    assert calls[-1]["variant"] == "stable" and calls[-1]["h_source"] == "actual"
    c["h_source"].value = "recorded"
    assert calls[-1]["h_source"] == "recorded" and calls[-1]["variant"] == "stable"
    assert len(calls) == 4
    assert "done" in panel.children[-2].value


def test_run_table_counts(folder):
    view = Algorithm1View(progress=False)
    run = view.run("hello", model_name=folder, tokens=2)
    assert "(2/2)" in run_table(run) or "/2)" in run_table(run)


def test_start_layer_slider_follows_the_model(folder, tmp_path, monkeypatch):
    import ipywidgets  # noqa: F401
    import ctxpatch_lite.views as views
    small = tmp_path / "two_layers"
    tiny_gemma3(seed=8, num_layers=2).save_pretrained(small)
    tiny_tokenizer().save_pretrained(small)
    monkeypatch.setattr(views, "available_models", lambda: {"tiny": folder, "two": str(small)})
    view = Algorithm1View(progress=False)
    panel = view.app(dict(prompt="hello there", model_name=folder, dtype="float32", tokens=2, variant="naive",
                          start_layer=3), n_layers=4, prompts=[{"id": "p", "text": "hello there"}])
    c = panel.controls
    assert c["start_layer"].max == 3
    c["model"].value = str(small)
    assert c["start_layer"].max == 1 and c["start_layer"].value == 1
    assert "done" in panel.children[-2].value and "start layer 1" in panel.children[-2].value
