"""Each figure function draws what its docstring says: the lines and bars, log axes where the point is a tail or a
span of magnitudes, integer ticks where the axis counts, labelled axes, distinct markers per configuration."""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from ctxpatch_lite import plots  # noqa: E402


@pytest.fixture(autouse=True)
def close():
    yield
    plt.close("all")


def _run(n=6, bad=(2,), scale=1e-6):
    return {"steps": [{"step": k, "linf": scale * (k + 1), "tvd": scale / 10, "match": k not in bad} for k in range(n)]}


def _labelled(ax):
    return ax.get_xlabel() and ax.get_ylabel()


def _integer_ticks(ax):
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    return all(float(t).is_integer() for t in ticks)


def test_per_token_lines_markers_mismatches_floors():
    runs = {"bfloat16-naive": _run(bad=()), "bfloat16-stable": _run(bad=(2, 4), scale=1e-1),
            "float32-naive": _run(bad=()), "float32-stable": _run(bad=())}
    fig = plots.per_token(runs, floors={"float32 ulp": 2e-6, "bfloat16 ulp": 0.125})
    linf, tvd = fig.axes[:2]
    assert linf.get_yscale() == tvd.get_yscale() == "log"
    data = [l for l in linf.get_lines() if l.get_label() in runs]
    assert len(data) == 4 and len({(l.get_marker(), l.get_linestyle()) for l in data}) == 4
    crosses = [l for l in linf.get_lines() if l.get_marker() == "X" and len(l.get_xdata())]   # run's colour, black edge
    stable = next(l for l in data if l.get_label() == "bfloat16-stable")
    assert len(crosses) == 1 and len(crosses[0].get_xdata()) == 2 and crosses[0].get_markeredgecolor() == "black"
    assert crosses[0].get_color() == stable.get_color()
    entries = [l.get_label() for l in linf.get_lines() if l.get_marker() == "X" and not l.get_label().startswith("_")]
    assert entries == ["top token differs (cross in the run's colour)"]   # one neutral legend entry for all crosses
    refs = [l for l in linf.get_lines() if l.get_label() in ("float32 ulp", "bfloat16 ulp")]
    assert len(refs) == 2 and len({(l.get_linestyle(), l.get_color()) for l in refs}) == 2
    assert all(l.get_markeredgewidth() > 0 for l in data)       # hollow markers stay visible (seaborn sets mew 0)
    assert _integer_ticks(tvd) and _labelled(tvd) and linf.get_ylabel()


def test_histograms_use_log_counts():
    fig = plots.h_histogram(torch.rand(1000) + 1e-7, n_zero=3)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and "exact zeros" in ax.get_title() and "3" in ax.get_title() and _labelled(ax)
    fig = plots.distributions({"float32-naive": np.logspace(-3, 6, 500), "bfloat16-stable": np.logspace(-2, 2, 500)},
                              "log10 |Δm_i|", "t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and len(ax.patches) == 2 and _labelled(ax)


def test_singular_values_integer_index():
    fig = plots.singular_values({"ΔW_gate": [1.0, 1e-8, 1e-9], "ΔW_up": [0.5, 1e-8, 1e-10]})
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 2 and ax.get_yscale() == "log" and _integer_ticks(ax)


def test_start_layer_sweep_plots_dv_at_the_start_layer():
    rows = [{"label": f"{dt}-naive", "start_layer": s, "n_match": 8, "n_tokens": 8, "linf_median": 1e-5,
             "dm_norm": 1e6, "matrix_norm": 3.0, "dv_first": 10.0 * (s + 1)} for dt in ("float32", "bfloat16")
            for s in (0, 6, 12, 17)]
    fig = plots.start_layer_sweep(rows)
    assert len(fig.axes) == 4
    match, linf, dv, norms = fig.axes
    assert "Δv" in dv.get_ylabel() and dv.get_yscale() == "log" and len(dv.get_lines()) == 2
    assert list(dv.get_lines()[0].get_ydata()) == [10.0, 70.0, 130.0, 180.0]
    assert abs(dv.get_lines()[0].get_xdata()[0] - dv.get_lines()[1].get_xdata()[0]) == pytest.approx(0.2)
    a, b = match.get_lines()          # identical values: told apart by marker and fill, not hidden
    assert (a.get_marker(), a.get_markerfacecolor()) != (b.get_marker(), b.get_markerfacecolor())
    assert all(_integer_ticks(ax) for ax in fig.axes) and len(norms.get_lines()) == 4


def test_family_errors_not_clipped_above_float64_errors():
    rows = {"float64": [{"family": "llama", "max_block_rel_error": 4e-16}, {"family": "gpt2", "max_block_rel_error": 1e-15}],
            "float32": [{"family": "llama", "max_block_rel_error": 1e-7}, {"family": "gpt2", "max_block_rel_error": 3e-7}]}
    fig = plots.family_errors(rows)
    ax = fig.axes[0]
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights[0] == pytest.approx(4e-16) and ax.get_ylim()[0] <= 4e-16
    assert ax.get_legend().get_bbox_to_anchor() is not None and ax.get_yscale() == "log"


def test_appendix_e_shows_the_running_sum_reaching_the_one_shot_patch():
    from ctxpatch_lite.appendix import appendix_e_outer
    from ctxpatch_lite.fixtures import tiny_model
    res = appendix_e_outer(tiny_model("llama", seed=0), [3, 9, 27, 81, 5, 7], layer=1)
    last = res["steps"][-1]
    assert last["gate_sum_norm"] == pytest.approx(res["gate_one_shot_norm"], rel=1e-12)
    assert last["gate_gap"] < 1e-12 and res["steps"][0]["gate_gap"] > 1e-6
    fig = plots.appendix_e_steps(res)
    left, right = fig.axes
    assert right.get_yscale() == "log" and len(left.patches) == 2 * len(res["steps"])
    dashed = [l for l in left.get_lines() if l.get_linestyle() == ":"]
    assert [l.get_ydata()[0] for l in dashed] == [res["gate_one_shot_norm"], res["down_one_shot_norm"]]
    assert all(_integer_ticks(ax) for ax in (left, right))


def test_secular_summary_update_norms_draw():
    from ctxpatch_lite.stable import invert_rmsnorm_unit
    g, m = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64), torch.tensor([1.0, 1.2, 0.8], dtype=torch.float64)
    inv = invert_rmsnorm_unit(g, m)
    ax = plots.secular_function(g, m, inv.mu).axes[0]
    assert _labelled(ax) and any(l.get_marker() == "o" for l in ax.get_lines())
    rows = [{"label": "float32-naive", "tvd": [1e-7, 2e-7], "n_match": 2, "n_tokens": 2, "matrix_norm": 4.0,
             "dm_norm": 1e6}, {"label": "bfloat16-stable", "tvd": [1e-2, 2e-2], "n_match": 1, "n_tokens": 2,
                               "matrix_norm": 4.5, "dm_norm": 7e2}]
    fig = plots.summary(rows)
    assert [t.get_text() for t in fig.axes[1].texts] == ["2/2", "1/2"]
    ax = plots.update_norms(rows).axes[0]
    assert ax.get_yscale() == "log" and len(ax.patches) == 4


def test_image_figures():
    from ctxpatch_lite.fixtures import tiny_gemma3_vision, tiny_vision_processor
    from ctxpatch_lite.vision import attention_mask, encode_context, packaged_image
    proc, model = tiny_vision_processor(), tiny_gemma3_vision()
    imgs = [packaged_image("mars_sunset"), packaged_image("robot")]
    ids, media = encode_context(proc, "<start_of_image> and <start_of_image> is", imgs, model)
    fig = plots.context_images(imgs, media.pixel_values, ["a", "b"])
    assert len(fig.axes) == 4 and fig.axes[2].get_images()[0].get_array().shape[:2] == (32, 32)
    fig = plots.attention_mask(attention_mask(model, ids, media), media.token_type_ids, [str(i) for i in ids])
    ax = fig.axes[0]
    blocks = [p for p in ax.patches if p.get_edgecolor()[:3] == matplotlib.colors.to_rgb("#d62728")]
    assert len(blocks) == 2 and all(p.get_width() == 4 for p in blocks)
    fig = plots.per_layer({"with the image": [1.0, 2.0, 3.0], "text only": [1.0, 1.5, 2.5]}, "‖Δm‖", "t",
                          reference={"target": 1e-10})
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and len(ax.get_lines()) == 3 and _integer_ticks(ax)


def test_headline_points_and_reference_lines():
    rows = [{"label": "full context", "linf": 0.0, "token": "a", "matches": True},
            {"label": "patched", "linf": 5e-6, "token": "a", "matches": True},
            {"label": "unpatched", "linf": 42.0, "token": "b", "matches": False}]
    fig = plots.headline(rows, floors={"one float32 step": 2e-6, "the baseline's own rounding": 1.5e-5})
    ax = fig.axes[0]
    points = [l for l in ax.get_lines() if l.get_marker() == "o"]
    assert ax.get_xscale() == "log" and not ax.patches and len(points) == 3        # points, not bars, on a log axis
    assert [float(l.get_xdata()[0]) for l in points] == [1e-12, 5e-6, 42.0]        # 0 drawn at the axis floor
    assert [l.get_color() for l in points] == ["#2ca02c", "#2ca02c", "#d62728"]   # green: the same top token
    refs = [l for l in ax.get_lines() if l.get_marker() != "o"]
    assert sorted(float(l.get_xdata()[0]) for l in refs) == [2e-6, 1.5e-5]
    assert len({str(l.get_linestyle()) for l in refs}) == 2                 # told apart by their dashes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["one float32 step", "the baseline's own rounding"]
    assert ax.get_xlim()[0] < 2e-6 and ax.get_xlabel()


def test_error_formula_draws_every_layer_and_counts_a_zero():
    rows = [{"layer": l, "predicted_k": (-1) ** l * 10.0 ** l, "measured_k": 1.05 * (-1) ** l * 10.0 ** l} for l in range(4)]
    ax = plots.error_formula(rows).axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    xy = ax.collections[0].get_offsets()
    assert len(xy) == 4 and (xy[:, 0] > 0).all()                 # sizes: the signs are dropped, not the points
    assert list(ax.collections[0].get_array()) == [0, 1, 2, 3]      # coloured by layer, with a colour bar
    assert len(ax.figure.axes) == 2
    both = [r | {"predicted_actual_k": 0.1 * (l + 1) * (l != 2), "measured_actual_k": 0.1 * (l + 1)} for l, r in enumerate(rows)]
    ax = plots.error_formula(both).axes[0]
    assert len(ax.collections[1].get_offsets()) == 3                 # the actual divisor's zero at layer 2 is not drawn
    assert "3 of 4 layers nonzero" in [t.get_text() for t in ax.get_legend().get_texts()][-1]
    zero = plots.error_formula(rows + [{"layer": 4, "predicted_k": 0.0, "measured_k": 1.0}]).axes[0]
    assert len(zero.collections[0].get_offsets()) == 4                # a zero miss is counted, not drawn
    assert "(4 of 5 layers nonzero)" in [t.get_text() for t in zero.get_legend().get_texts()][1]
    with pytest.raises(ValueError, match="finite"):
        plots.error_formula(rows + [{"layer": 4, "predicted_k": float("inf"), "measured_k": 1.0}])

def test_cause2_targets_splits_the_coordinates_and_counts_the_zeros_it_cannot_draw():
    fig = plots.cause2_targets([0.3, 0.6, 0.9], [0.5, 2.0, 40.0, 1e3, 0.0])
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    assert [sum(p.get_height() for p in c) for c in ax.containers] == [4]    # kept, the zero not drawn
    assert 1.0 in {p.get_x() for c in ax.containers for p in c}    # a bin edge at exactly one step: no bar straddles it
    ticks = [l for l in ax.get_lines() if l.get_marker() == "|"]
    assert len(ticks) == 1 and list(ticks[0].get_xdata()) == [0.3, 0.6, 0.9]   # one tick per fallback
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("5 coordinates; 1 with a target of 0, not drawn" in t for t in labels) and any("(3)" in t for t in labels)
    assert [float(l.get_xdata()[0]) for l in ax.get_lines() if l.get_marker() != "|"] == [1.0]   # Exercise 4's line
    with pytest.raises(ValueError, match="sizes"):
        plots.cause2_targets([-1.0], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        plots.cause2_targets([], [])


def test_paired_tvd_counts_and_refuses_unpaired():
    ref = [1e-2, 2e-2, 3e-2, 0.0]
    fig = plots.paired_tvd([("bfloat16-naive/actual", ref, "bfloat16-naive/recorded", [2e-2, 1e-2, 3e-2, 1e-3]),
                            ("bfloat16-naive/actual", ref, "bfloat16-stable/actual", [5e-3, 4e-2, 6e-2, 0.0]),
                            ("bfloat16-stable/actual", [5e-3, 4e-2, 6e-2, 0.0], "bfloat16-stable/recorded",
                             [5e-3, 4e-2, 6e-2, 0.0])])
    titles = [ax.get_title() for ax in fig.axes]
    assert "above y = x on 2 of 4" in titles[0] and "below on 1, on it on 1" in titles[0]
    assert "above y = x on 2 of 4" in titles[1] and "below on 1, on it on 1" in titles[1]
    assert "above y = x on 0 of 4" in titles[2] and "on it on 4" in titles[2]
    assert fig.axes[2].get_xlabel() == "TVD, bfloat16-stable/actual"
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert any("1 with a TVD of 0, not drawn" in t for t in labels)
    assert all(ax.get_xscale() == "log" and ax.get_yscale() == "log" for ax in fig.axes)
    grid = plots.paired_tvd([("ref", ref, "y", ref)] * 4)          # four panels: a 2 x 2 grid, all visible
    assert len(grid.axes) == 4 and all(ax.get_visible() for ax in grid.axes)
    assert grid.axes[2].get_position().y1 < grid.axes[0].get_position().y0
    five = plots.paired_tvd([("ref", ref, "y", ref)] * 5)          # five: two rows of three, the sixth hidden
    assert sum(ax.get_visible() for ax in five.axes) == 5
    with pytest.raises(ValueError, match="pair them token by token"):
        plots.paired_tvd([("ref", ref, "x", [1e-2])])
    with pytest.raises(ValueError, match="finite and >= 0"):
        plots.paired_tvd([("ref", [1e-2], "x", [float("nan")])])


def test_rounding_difference_counts_the_coordinates_above_the_line():
    h_C = torch.tensor([1e-4, 1e-2, 0.5, 0.0])
    dh = torch.tensor([1e-3, 1e-3, 1e-3, 2e-3])
    fig = plots.rounding_difference(h_C, dh, torch.full((4,), 1e-2), layer=3)
    ax, ax2 = fig.axes
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("above it: 2 coordinates" in t for t in texts) and "1 with a 0, not drawn" in texts
    assert "one coordinate each (3)" in texts
    marked = plots.rounding_difference(h_C, dh, torch.full((4,), 1e-2), layer=3,
                                       same=torch.tensor([False, True, False, False])).axes[0]
    texts = [t.get_text() for t in marked.get_legend().get_texts()]
    assert "product differs (2)" in texts and "product bit-identical (1)" in texts   # the zero is counted apart
    with pytest.raises(ValueError, match="each coordinate"):
        plots.rounding_difference(h_C, dh, dh, layer=0, same=[True])
    assert ax.get_xscale() == ax.get_yscale() == ax2.get_xscale() == "log"
    assert any("largest 0.2" in t.get_text() for t in ax2.get_legend().get_texts())
    with pytest.raises(ValueError, match="common"):
        plots.rounding_difference(h_C, dh[:2], dh, layer=0)
