"""The rules that judge a rerun on another CPU (ctxpatch_lite.arithmetic): tokens where the arithmetic promises
them, ties flagged apart, per-run distances within bands, notebook metrics under named rules, and the record of
the arithmetic path."""
import copy
import math

import pytest

from ctxpatch_lite import arithmetic as ar


def step(i, match=True, linf=1e-5, tvd=1e-6, margin=3.0, baseline=7, patched=None, query=5):
    return {"step": i, "query_token": query + i, "baseline_token": baseline + i,
            "patched_token": (baseline + i) if patched is None else patched, "match": match, "linf": linf,
            "tvd": tvd, "margin": margin, "logit_scale": 30.0}


def run(steps, pid="mars"):
    return {"prompt_id": pid, "steps": steps}


F32 = {"dtype": "float32", "h_source": "actual", "schedule": "selfcorrect"}
BF16 = {"dtype": "bfloat16", "h_source": "actual", "schedule": "selfcorrect"}


def test_identical_runs_pass_and_report_zero_differences():
    ref = [run([step(i) for i in range(5)])]
    cmp = ar.compare_runs(copy.deepcopy(ref), ref, F32, "x")
    assert cmp.ok and cmp.ties == [] and cmp.compared == 5
    assert cmp.worst["linf"] == {"median": 0.0, "max": 0.0, "step": 0.0}


def test_a_lost_token_at_a_wide_margin_is_a_regression():
    ref = [run([step(i) for i in range(5)])]
    new = copy.deepcopy(ref)
    new[0]["steps"][3].update(match=False, patched_token=99)
    cmp = ar.compare_runs(new, ref, F32, "x")
    assert len(cmp.problems) == 1 and "step 3: the patched token no longer matches" in cmp.problems[0]


def test_a_flip_at_a_near_tie_is_flagged_not_failed():
    ref = [run([step(i, margin=0.2 if i == 2 else 3.0, linf=0.125) for i in range(5)])]
    new = copy.deepcopy(ref)
    new[0]["steps"][2].update(match=False, patched_token=99)
    cmp = ar.compare_runs(new, ref, BF16, "x")
    assert cmp.ok and len(cmp.ties) == 1 and "not promised" in cmp.ties[0]


def test_the_baselines_own_tie_ends_the_comparison_of_that_prompt():
    noise = ar.LOGIT_NOISE_ULPS["bfloat16"] * ar.ulp(30.0, "bfloat16")
    ref = [run([step(i, margin=noise / 2 if i == 1 else 3.0) for i in range(5)])]
    new = copy.deepcopy(ref)
    for s in new[0]["steps"][1:]:                       # the baseline took the other token: another history
        s["baseline_token"] += 1000
        s["linf"] = 5.0
    cmp = ar.compare_runs(new, ref, BF16, "x")
    assert cmp.ok and cmp.compared == 1 and "changed at a tie" in cmp.ties[0]
    wide = copy.deepcopy(ref)
    wide[0]["steps"][1]["margin"] = 3.0
    cmp = ar.compare_runs(new, wide, BF16, "x")         # the same change at a wide margin: a regression
    assert not cmp.ok and "baseline token" in cmp.problems[0]


@pytest.mark.parametrize("klass,config", [("float32", F32), ("bfloat16", BF16)])
def test_distances_are_judged_per_run_by_median_and_max(klass, config):
    band = ar.BANDS[klass]["linf"]
    base = 1e-5 if klass == "float32" else 0.125
    ref = [run([step(i, linf=base) for i in range(5)])]
    inside = copy.deepcopy(ref)
    inside[0]["steps"][4]["linf"] = base + 0.9 * band.abs
    assert ar.compare_runs(inside, ref, config).ok
    outside = copy.deepcopy(ref)
    outside[0]["steps"][4]["linf"] = base + band.abs * 1.5 + band.rel * base + 1e-12
    cmp = ar.compare_runs(outside, ref, config)
    assert [p for p in cmp.problems if "max linf" in p] and not [p for p in cmp.problems if "median linf" in p]


def test_amplified_runs_have_their_own_band():
    assert ar.noise_class({"dtype": "float32", "h_source": "recorded"}) == "float32-amplified"
    assert ar.noise_class({"dtype": "float32", "schedule": "ideal"}) == "float32-amplified"
    assert ar.noise_class({"dtype": "bfloat16", "h_source": "recorded"}) == "bfloat16-amplified"
    assert ar.noise_class({"dtype": "bfloat16", "h_source": "actual"}) == "bfloat16"
    cfg = {**F32, "h_source": "recorded"}
    ref = [run([step(i, linf=2e-3, tvd=1e-4) for i in range(5)])]
    new = copy.deepcopy(ref)
    for s in new[0]["steps"]:
        s["linf"] *= 1.8                                  # the same order of magnitude: inside
    assert ar.compare_runs(new, ref, cfg).ok
    assert not ar.compare_runs(new, ref, F32).ok        # the plain float32 band would not allow it
    for s in new[0]["steps"]:
        s["linf"] *= 100
    assert not ar.compare_runs(new, ref, cfg).ok
    lost = copy.deepcopy(ref)                            # no step of an amplified run is promised: a flip is a tie
    lost[0]["steps"][2].update(match=False, patched_token=99)
    assert ar.compare_runs(lost, ref, cfg).ok and ar.compare_runs(lost, ref, cfg).ties


def test_a_history_that_leaves_at_a_tie_or_at_an_unpromised_free_token():
    noise = ar.LOGIT_NOISE_ULPS["bfloat16"] * ar.ulp(30.0, "bfloat16")
    ref = [run([step(i, margin=noise / 2 if i == 1 else 9.0, linf=0.125) for i in range(5)])]
    new = copy.deepcopy(ref)
    for s in new[0]["steps"][2:]:                        # batched: the greedy token after step 1 was the other one
        s["query_token"] += 1000
    cmp = ar.compare_runs(new, ref, BF16)
    assert cmp.ok and cmp.compared == 2 and "after a tie of the baseline at step 1" in cmp.ties[0]
    wide = copy.deepcopy(ref)
    wide[0]["steps"][1]["margin"] = 9.0
    assert "query token" in ar.compare_runs(new, wide, BF16).problems[0]
    free = {**BF16, "forcing": "patched"}                # free-running: the patched model's own token led
    for r in (wide, new):                                # step 1: both missed the token, with a large L-inf
        r[0]["steps"][1].update(match=False, linf=6.0, patched_token=99)
    cmp = ar.compare_runs(new, wide, free)
    assert cmp.ok and "patched token at step 1" in cmp.ties[0]


def test_grid_tolerances_override_a_class_and_are_checked():
    b = ar.bands_with({"float32": {"linf": [0.5, 0]}})
    assert b["float32"]["linf"].abs == 0.5 and b["float32"]["tvd"] == ar.BANDS["float32"]["tvd"]
    for bad, message in (({"float16": {"linf": [1, 0]}}, "not a noise class"),
                         ({"float32": {"linf": [1]}}, "maps linf and/or tvd"), (3, "maps a noise class")):
        with pytest.raises(ValueError, match=message):
            ar.bands_with(bad)


def test_metric_rules_by_name_inline_and_per_dtype():
    rules = {"err*": "rounding", "bf.*": "rounding:bfloat16", "n": "exact",
             "t": {"kind": "abs", "value": 2, "why": "a count near a threshold"}}
    assert ar.compare_metrics({"err": 3e-7, "n": 4, "t": 5}, {"err": 1e-7, "n": 4, "t": 3}, rules) == []
    problems = ar.compare_metrics({"err": 0.5, "n": 5, "t": 6}, {"err": 1e-7, "n": 4, "t": 3}, rules)
    assert len(problems) == 3 and all("rule" in p for p in problems)
    bf = ar.RULES["rounding"].at("bfloat16")      # a rule's value is taken at the run's dtype
    assert ar.compare_metrics({"dtype": "bfloat16", "err": bf / 2}, {"dtype": "bfloat16", "err": bf / 4}, rules) == []
    assert ar.compare_metrics({"err": bf / 2}, {"err": bf / 4}, rules)
    assert ar.compare_metrics({"bf.x": bf / 2}, {"bf.x": bf / 4}, rules) == []     # the rule names its dtype
    assert "has no rule" in ar.compare_metrics({"x": 1.5}, {"x": 1.5}, {})[0]
    assert "is new" in ar.compare_metrics({"x": 1, "y": 2}, {"x": 1}, {})[0]
    assert "missing" in ar.compare_metrics({}, {"x": 1}, {})[0]
    assert ar.compare_metrics({"x": math.nan}, {"x": math.nan}, {"x": "rounding"}) == []
    with pytest.raises(ValueError, match="unknown metric rule"):
        ar.rule_of("nosuch")
    with pytest.raises(ValueError, match="a reason"):
        ar.rule_of({"kind": "abs", "value": 1})


def test_the_arithmetic_path_is_recorded_with_every_run(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    path = ar.arithmetic_path()
    assert path["cpu_capability"] and path["variables"]["MKL_CBWR"] == "COMPATIBLE"
    from ctxpatch_lite.protocol import environment
    assert environment()["arithmetic_path"]["cpu_capability"] == path["cpu_capability"]


def test_the_makefile_runs_the_second_path_from_the_package():
    from pathlib import Path
    text = (Path(__file__).parent.parent / "Makefile").read_text()
    assert "SECOND_PATH" in text and "ctxpatch_lite.arithmetic" in text


def test_ulp():
    assert ar.ulp(20.0, "bfloat16") == 0.125 and ar.ulp(32.0, "bfloat16") == 0.25
    assert ar.ulp(1.0, "float32") == 2.0 ** -23


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ulps_is_ulp_elementwise(dtype):
    import torch
    x = torch.tensor([20.0, -32.0, 0.0474, 1.0, -0.99, 3e-5, 0.0])
    got = ar.ulps(x, dtype)
    want = [0.0 if v == 0 else ar.ulp(float(v), dtype) for v in x]
    assert got.tolist() == want


def test_the_most_specific_rule_wins_over_a_wildcard_of_the_same_length():
    from ctxpatch_lite.arithmetic import rule_for
    rules = {"a.*.b": "rounding", "a.1.b": {"kind": "any", "why": "a layer whose size is arbitrary"}}
    assert rule_for("a.1.b", 1.0, rules)[0] == "a.1.b"
    assert rule_for("a.2.b", 1.0, rules)[0] == "a.*.b"
