"""Solutions to the course's exercises. Try the exercise first: the notebook's cell is a stub, and its check says
what is wrong with your answer. While a stub is unwritten, the check runs the solution from here instead (and says
so), so the notebook still runs to the end.

=======================  =================================================  ===========================
lesson                   the function you write                             the check
=======================  =================================================  ===========================
01 a Gemma 3 block       ``rms_norm(x, w, eps)``                            ``exercises.check_rms_norm``
01                       ``gemma_block(block, x, positions) -> (v, z, h_g,   ``exercises.check_gemma_block``
                         out)``
02 Theorem 1             ``input_patch(W, z, z_C) -> dW``                   ``exercises.check_input_patch``
02                       ``scale_patch(v, v_C, h, m) -> dm``                ``exercises.check_scale_patch``
03 Algorithm 1           ``theorem1_block(block, x, position, target)``     ``exercises.check_theorem1_block``
                         ``-> (out, (dW_gate, dW_up, dm))``
03                       ``algorithm1(model, ids, tools) -> logits``        ``exercises.check_algorithm1``
03                       ``patched_layer(block, x, position, patches)``     ``exercises.check_patched_layer``
04 Appendix B            ``secular_root(g, m) -> mu``                       ``exercises.check_secular_root``
04                       ``stable_patch(g, m, mu, h_g_C, h_down_C, eps)``   ``exercises.check_stable_patch``
                         ``-> (dW_down, dm)``
04                       ``naive_miss(m, dm, dh, divide_by)``               ``exercises.check_naive_miss``
04b bfloat16 up close    ``bf16_step(x)``                                   ``exercises.check_bf16_step``
04b                      ``hard_case_y(g, m) -> y``                         ``exercises.check_hard_case_y``
04b                      ``sum_condition(W, x) -> kappa``                   ``exercises.check_sum_condition``
=======================  =================================================  ===========================
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise in float32 (float64 stays float64), scale by (1 + w), cast back to x's dtype."""
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (n * (1.0 + w.to(cdt))).to(x.dtype)


def gemma_block(block, x: torch.Tensor, positions: torch.Tensor | None = None):
    """One Gemma 3 decoder layer on the rows ``x`` (T, d) of one sequence, from its parts (``block``: a
    ``ctxpatch_lite.block.GemmaBlock``): returns ``(v, z, h_g, out)``.

        v   = x + RMSNorm_post-attn(Attn(RMSNorm_in(x)))
        z   = RMSNorm_pre-FF(v)
        h_g = GELU_tanh(W_gate z) * (W_up z)
        out = v + RMSNorm_post-FF(W_down h_g)
    """
    n = block.norms
    attn = block.attention(rms_norm(x, n["input_layernorm"], block.eps), positions)
    v = x + rms_norm(attn, n["post_attention_layernorm"], block.eps)
    z = rms_norm(v, n["pre_feedforward_layernorm"], block.eps)
    h_g = torch.nn.functional.gelu(z @ block.W_gate.T, approximate="tanh") * (z @ block.W_up.T)
    out = v + rms_norm(h_g @ block.W_down.T, n["post_feedforward_layernorm"], block.eps)
    return v, z, h_g, out


def input_patch(W: torch.Tensor, z: torch.Tensor, z_C: torch.Tensor) -> torch.Tensor:
    """Eqs. 2-3: dW = W (z_C - z) z^T / ||z||^2, so that (W + dW) z = W z_C. W (out, in); z, z_C (in,).
    Of all the matrices with dW z = W (z_C - z), this one has the smallest Frobenius norm."""
    return torch.outer(W @ (z_C - z), z) / z.dot(z)


def scale_patch(v: torch.Tensor, v_C: torch.Tensor, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Eq. 4: dm = (v_C - v) / h, dividing by 1 where h_i == 0 exactly (the paper's guard), so that
    v + (m + dm) * h = v_C + m * h wherever h_i != 0. ``m`` is not needed: dm is a change of the scale, the same
    whether the model stores m or w = m - 1."""
    return (v_C - v) / torch.where(h == 0, torch.ones_like(h), h)


@torch.no_grad()
def theorem1_block(block, x: torch.Tensor, position: int, target, input_patch=input_patch,
                   scale_patch=scale_patch) -> torch.Tensor:
    """Lesson 02 on one layer of the loop (03): the row ``x`` alone through ``block`` at ``position``, patched by
    Theorem 1 against the full-context ``target`` (its ``z_C`` and ``v_C``): the input patches of W_gate and W_up,
    the patched MLP on the query's own z, then the scale patch on the h that MLP gives. Returns the output row and
    the three patches ``(dW_gate, dW_up, dm)``."""
    tr = block(x[None], positions=torch.tensor([position]))
    v, z = tr.v[0], tr.z[0]
    W_gate = block.W_gate + input_patch(block.W_gate, z, target.z_C)
    W_up = block.W_up + input_patch(block.W_up, z, target.z_C)
    h_g = torch.nn.functional.gelu(W_gate @ z, approximate="tanh") * (W_up @ z)
    y = block.W_down @ h_g
    h = y / torch.sqrt(y.pow(2).mean() + block.eps)                   # N(W_down h_g)
    m = 1.0 + block.norms["post_feedforward_layernorm"]
    dm = scale_patch(v, target.v_C, h, m)
    return v + (m + dm) * h, (W_gate - block.W_gate, W_up - block.W_up, dm)


def patched_layer(block, x: torch.Tensor, position: int, patches) -> torch.Tensor:
    """Lesson 03, Exercise 3: layer ``block`` on the row ``x`` alone, with ``patches = (dW_gate, dW_up, dm)`` applied
    as given, whatever input they were built for: out = v + (m + dm) N(W_down h_g), where v and z come from ``x`` and
    h_g = GELU((W_gate + dW_gate) z) (W_up + dW_up) z. Built for this very ``x``, the patches give Theorem 1's
    output; built for another input (the ideal schedule), they miss it."""
    dW_gate, dW_up, dm = patches
    tr = block(x[None], positions=torch.tensor([position]))
    v, z = tr.v[0], tr.z[0]
    h_g = torch.nn.functional.gelu((block.W_gate + dW_gate) @ z, approximate="tanh") * ((block.W_up + dW_up) @ z)
    y = block.W_down @ h_g
    h = y / torch.sqrt(y.pow(2).mean() + block.eps)                   # N(W_down h_g)
    return v + (1.0 + block.norms["post_feedforward_layernorm"] + dm) * h


def algorithm1(model, ids: list, tools) -> torch.Tensor:
    """Algorithm 1 for the last token of ``ids``: every layer patched from the actual output of the patched layer
    below, on the query alone; returns the next-token logits."""
    targets = tools.full_context_targets(model, ids)      # one record per layer: v_C, z_C at the query
    x = tools.query_embedding(model, ids)                  # the query token alone
    position = len(ids) - 1
    for layer, block in enumerate(tools.blocks(model)):
        x = tools.theorem1_block(block, x, position, targets[layer])
    return tools.logits(model, x)


def run_schedule(model, ids: list, targets: list, ideal: bool, tools) -> list:
    """Lesson 03, Exercise 4: the last token of ``ids`` alone through every layer under one schedule, against the
    full-context ``targets``; returns each layer's output row, in order. Layer l's patches are built for the row it
    is fed (Algorithm 1) or, with ``ideal``, for the recorded full-context input ``targets[l].x_C`` (the paper's
    ideal schedule); either way the layer then runs on the row it is fed, the output of the patched layer below."""
    x, position, outs = tools.query_embedding(model, ids), len(ids) - 1, []
    for block, t in zip(tools.blocks(model), targets):
        built_for = t.x_C if ideal else x
        x = tools.patched_layer(block, x, position, tools.patches(block, built_for, position, t))
        outs.append(x)
    return outs


def secular(mu, g: torch.Tensor, m: torch.Tensor):
    """F(mu) = mean_k (g_k m_k)^2 / (m_k^2 - mu)^2 - 1, increasing on (-inf, min m^2) (Appendix B)."""
    return ((g * m) ** 2 / (m ** 2 - mu) ** 2).mean() - 1


def secular_root(g: torch.Tensor, m: torch.Tensor, steps: int = 200) -> float:
    """The root mu* < min m^2 of F (Appendix B), by bisection: F(lo) < 0 at lo = min m^2 - sqrt(mean (g m)^2) - 1
    (every (m_k^2 - lo)^2 exceeds mean (g m)^2 there), F -> +inf at min m^2. Then y = g m / (m^2 - mu*) has
    mean(y^2) = 1."""
    g, m = g.double(), m.double()
    m2 = float((m ** 2).min())
    lo, hi = m2 - float(((g * m) ** 2).mean().sqrt()) - 1.0, m2
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        lo, hi = (mid, hi) if float(secular(mid, g, m)) < 0 else (lo, mid)
    return lo


def stable_patch(g: torch.Tensor, m: torch.Tensor, mu: float, h_g_C: torch.Tensor, h_down_C: torch.Tensor,
                 eps: float):
    """Steps 3 and 4 of Appendix B's stable update (04), given the post-norm's target ``g`` and the root ``mu`` of
    the secular equation: the unit-RMS minimiser y = g m / (m^2 - mu), h_target = RMS(h_down_C) y, the rank-1
    dW_down = (h_target - h_down_C) h_g_C^T / ||h_g_C||^2, and the remainder dm = (g - m N(h_target)) / N(h_target)
    (divided by 1 where N(h_target) is exactly 0). Returns (dW_down, dm)."""
    y = g * m / (m ** 2 - mu)
    h_target = h_down_C.pow(2).mean().sqrt() * y
    dW_down = torch.outer(h_target - h_down_C, h_g_C) / h_g_C.dot(h_g_C)
    n_t = h_target / torch.sqrt(h_target.pow(2).mean() + eps)
    dm = (g - m * n_t) / torch.where(n_t == 0, torch.ones_like(n_t), n_t)
    return dW_down, dm


def naive_miss(m: torch.Tensor, dm: torch.Tensor, dh: torch.Tensor, divide_by: str) -> torch.Tensor:
    """Lesson 04, Exercise 3: the naive patch's output v + (m + dm) h_hat minus the target v_C + m h_C, per
    coordinate, written with m, dm and dh = h_hat - h_C alone (where the divisor is not 0). dm = (v_C - v) / h_C
    (``divide_by="recorded"``) gives (m + dm) dh; dm = (v_C - v) / h_hat (``"actual"``) gives m dh."""
    if divide_by not in ("recorded", "actual"):
        raise ValueError(f"divide_by must be 'recorded' or 'actual', got {divide_by!r}")
    return (m + dm) * dh if divide_by == "recorded" else m * dh


def sum_condition(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Lesson 04b, Exercise 2: the condition number of each coordinate of the product W x, kappa_k =
    sum_j |W_kj x_j| / |sum_j W_kj x_j|: how much the terms' size exceeds the sum they give. If every term moves by a
    relative delta, the sum moves by up to delta sum_j |W_kj x_j|, so relative to itself by up to delta kappa_k.
    float64 throughout (where the terms cancel, a float32 or bfloat16 sum loses the very digits kappa measures);
    inf where the sum is exactly 0. ``W``: (d, f); ``x``: (f,). Returns float64 (d,)."""
    W, x = W.double(), x.double()
    return (W.abs() @ x.abs()) / (W @ x).abs()


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """Lesson 04b, Exercise 1: the spacing of bfloat16 numbers at each |x| (one bfloat16 step), as float32: with
    |x| = f 2^e, 1 <= f < 2, the step is 2^(e - 7), since bfloat16 keeps 7 bits after the leading one; 0 where x is
    0. frexp gives e exactly (x = f' 2^e' with 0.5 <= f' < 1, so e = e' - 1), where log2 in float32 can round a value
    just below a power of two up to it."""
    x = x.float()
    step = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 1 - 7)
    return torch.where(x == 0, torch.zeros_like(step), step)


def exact_zeros(W_down: torch.Tensor, h_g: torch.Tensor, h_target: torch.Tensor) -> torch.Tensor:
    """Lesson 04b, Exercise 3: where the stable patch's bfloat16 layer computes an exact 0 (step 4's divisor, the
    fallbacks of both causes). The patched layer adds two bfloat16 numbers: its own output (W_down h_g)_k, computed
    in bfloat16 as the layer computes it, and the correction h_target,k - (W_down h_g)_k, computed in float32 and
    rounded to bfloat16. ``W_down``: the layer's bfloat16 weight (d, f); ``h_g``: float32 (f,) holding bfloat16
    values; ``h_target``: float32 (d,). A boolean mask (d,)."""
    own = W_down @ h_g.to(W_down.dtype)                                         # the layer's own output
    correction = (h_target.float() - W_down.float() @ h_g.float()).to(W_down.dtype)   # float32, then rounded
    return own + correction == 0


def cause2_candidates(own: torch.Tensor, target: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Lesson 04b, Exercise 4: the coordinates where a cause-2 fallback can happen (stable variant, divisor
    "actual"): a nonzero scale m_k, and a target |h_target,k| below one bfloat16 step of the layer's own term
    (W_down h_g)_k, ``own``. There the bfloat16 sum of the own term and the rounded correction can cancel exactly.
    Returns a boolean mask."""
    return (m != 0) & (target.abs() < bf16_step(own))


def hard_case_y(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Lesson 04b, Exercise 5 (the appendix): Appendix B's step-2 minimiser in the *hard case* (no root of F below min m^2: every
    coordinate of smallest m_k^2 has g_k m_k = 0, and F <= 0 at min m^2 without them). mu = min m^2; every other
    coordinate gets y_k = g_k m_k / (m_k^2 - mu); the leftover norm n - sum of their y_k^2 is split evenly, with a
    positive sign, over the smallest-m^2 coordinates (the engine's choice, ``stable.invert_rows``), so mean(y^2) = 1."""
    g, m = g.double(), m.double()
    m2 = m ** 2
    at_min = m2 == m2.min()
    y = torch.where(at_min, torch.zeros_like(g), g * m / torch.where(at_min, torch.ones_like(m2), m2 - m2.min()))
    leftover = g.numel() - float((y ** 2).sum())
    return torch.where(at_min, torch.full_like(g, (max(leftover, 0.0) / int(at_min.sum())) ** 0.5), y)
