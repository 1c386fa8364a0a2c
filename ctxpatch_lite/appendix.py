"""Appendix D (a block no upstream patch can fix) and Appendix E (patches as telescoping gradient steps).

Appendix D: if the MLP's post-norm has no trainable scale, its output has norm at most ``sqrt(d) ||m||_inf``, so
any change of the upstream weights moves the block output by at most ``2 sqrt(d) ||m||_inf``. A context whose
``dv = v_C - v`` is longer than that cannot be absorbed: ``||out' - out_C|| >= ||dv|| - 2 sqrt(d) ||m||_inf``.
``appendix_d`` builds such a case and lets Adam search all upstream matrices; the residual never crosses the bound.

Appendix E: with the trace pseudo-loss ``L(W) = -Tr(D^T W)``, ``grad L = -D``, so one unit gradient step adds ``D``.
Absorbing the context one token at a time (contexts C_0 = {} < C_1 < ... < C_n = C, the last k context tokens
before the query) with a *fixed preconditioner* gives per-step patches that sum to the one-shot patch:
``appendix_e_outer`` for a Llama-style block (input matrices and the outer ``down_proj``), ``appendix_e_stable``
for the stable Gemma variant (``W_down`` towards successive inverted targets, ``dm`` with the fixed element-wise
preconditioner ``N(h_target,n)``; a moving preconditioner does not telescope).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import trange

from .engine import Recorder
from .families import Adapter
from .hooks import float64_norms, unit_rms
from .metrics import relative_error
from .stable import invert_rmsnorm


def _norm(y: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return unit_rms(y, eps)


def appendix_d(d: int = 16, hidden: int = 32, excess: float = 3.0, steps: int = 400, seed: int = 0,
               progress: bool = False) -> dict:
    """A post-norm block ``out = v + m * N(W_down (gelu(W_gate z) * W_up z))``, ``z = N(v)``, with a fixed ``m``.

    The context shifts ``v`` by ``dv`` with ``||dv|| = excess * 2 sqrt(d) ||m||_inf``. Adam then searches every
    upstream matrix (``W_gate``, ``W_up``, ``W_down``, unconstrained) to make the no-context block hit the
    full-context output. Returns the bound, the best residual found, and the same target reached exactly by a
    trainable-scale patch ``dm = dv / h`` for contrast.
    """
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    W = {"gate": rnd(hidden, d) / math.sqrt(d), "up": rnd(hidden, d) / math.sqrt(d),
         "down": rnd(d, hidden) / math.sqrt(hidden)}
    m = 1.0 + 0.3 * rnd(d)                                   # a fixed (non-trainable) post-norm scale

    def normalized_mlp(v, Wg, Wu, Wd):                    # h = N(W_down (gelu(W_gate z) * W_up z)), z = N(v)
        z = _norm(v)
        return _norm(F.linear(F.gelu(F.linear(z, Wg)) * F.linear(z, Wu), Wd))

    def block(v, Wg, Wu, Wd):
        return v + m * normalized_mlp(v, Wg, Wu, Wd)

    bound = 2.0 * math.sqrt(d) * float(m.abs().max())
    v = rnd(d)
    direction = rnd(d)
    dv = excess * bound * direction / direction.norm()
    v_C = v + dv
    target = block(v_C, W["gate"], W["up"], W["down"])
    params = {k: w.clone().requires_grad_(True) for k, w in W.items()}
    opt = torch.optim.Adam(params.values(), lr=0.05)
    history = []
    for _ in trange(steps, desc="Appendix D search", disable=not progress, leave=False):
        opt.zero_grad()
        loss = (block(v, params["gate"], params["up"], params["down"]) - target).norm()
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
    # contrast: with a trainable scale, Theorem 1's patch (input patches make the MLP see z_C, so its normalised
    # output is h = N(y_C); then dm = dv / h) reaches the target exactly
    with torch.no_grad():
        h = normalized_mlp(v_C, W["gate"], W["up"], W["down"])
        exact = v + (m + dv / h) * h
    return dict(d=d, dv_norm=float(dv.norm()), m_inf=float(m.abs().max()), bound=bound,
                lower_bound_on_residual=float(dv.norm()) - bound, best_residual=min(history), initial_residual=history[0],
                history=history, steps=steps, trainable_scale_residual=float((exact - target).norm()),
                min_abs_h=float(h.abs().min()))


@torch.no_grad()
def _growing_contexts(model, prompt_ids: list, layer: int) -> tuple:
    """(adapter, [Targets of ``layer`` at the query, 1-D]) for the contexts C_0 = {} ... C_n = all tokens before it."""
    ad = Adapter(model)
    query, ctx = prompt_ids[-1], prompt_ids[:-1]
    records = []
    for k in range(len(ctx) + 1):
        ids = torch.tensor([ctx[len(ctx) - k:] + [query]], device=next(model.parameters()).device)
        with float64_norms(model, ad.family.scale_offset), Recorder(ad) as rec:
            model(input_ids=ids, use_cache=False)
        records.append(rec.targets()[layer].select(0))
    return ad, records


def unit_trace_step(W: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """One gradient step of size 1 on ``L(W) = -Tr(D^T W)``, computed by autograd (it equals ``W + D``)."""
    Wp = W.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = -(D * Wp).sum()               # -Tr(D^T W)
        loss.backward()
    return (Wp - Wp.grad).detach()


def appendix_e_outer(model, prompt_ids: list, layer: int = 0) -> dict:
    """Case 1 (Llama-style block, float64): input-matrix and outer-matrix increments telescope to the one-shot patch.

    Preconditioners are fixed: the no-context MLP input ``z_0`` for the input matrices, the patched hidden ``h``
    for ``down_proj``. Each increment is applied as an autograd unit step on the trace pseudo-loss.
    """
    ad, T = _growing_contexts(model, prompt_ids, layer)
    P = ad.parts[layer]
    if P.kind != "matrix":
        raise ValueError(f"appendix_e_outer needs an outer-matrix block (Llama-style); {ad.family.key} has "
                         f"{P.kind}")
    z0, v0 = T[0].z.to(torch.float64), T[0].v.to(torch.float64)
    gate, up = dict(P.inputs)["gate_proj"], dict(P.inputs)["up_proj"]
    Wg, Wu, Wd = (m.weight.detach().to(torch.float64) for m in (gate, up, P.output))
    n2 = float(z0 @ z0)
    Wg_k, Wd_k, steps = Wg.clone(), Wd.clone(), []
    one_gate = torch.outer(Wg @ (T[-1].z.double() - z0), z0) / n2
    Wg_full, Wu_full = Wg + one_gate, Wu + torch.outer(Wu @ (T[-1].z.double() - z0), z0) / n2
    h = P.mlp.act_fn(Wg_full @ z0) * (Wu_full @ z0)          # the hidden after the one-shot input patches
    one_down = torch.outer(T[-1].v.double() - v0, h) / float(h @ h)
    for k in range(1, len(T)):
        D_gate = torch.outer(Wg @ (T[k].z.double() - T[k - 1].z.double()), z0) / n2
        D_down = torch.outer(T[k].v.double() - T[k - 1].v.double(), h) / float(h @ h)
        Wg_k, Wd_k = unit_trace_step(Wg_k, D_gate), unit_trace_step(Wd_k, D_down)
        steps.append(dict(k=k, gate_step_norm=float(D_gate.norm()), down_step_norm=float(D_down.norm()),
                          gate_sum_norm=float((Wg_k - Wg).norm()), down_sum_norm=float((Wd_k - Wd).norm()),
                          gate_gap=relative_error(Wg_k - Wg, one_gate), down_gap=relative_error(Wd_k - Wd, one_down)))
    # the summed patches reproduce the full-context block output from the no-context v
    out = v0 + F.linear(h, Wd_k)
    target = T[-1].out.double()
    return dict(family=ad.family.key, layer=layer, n_context=len(T) - 1, steps=steps,
                gate_one_shot_norm=float(one_gate.norm()), down_one_shot_norm=float(one_down.norm()),
                gate_telescoping_error=relative_error(Wg_k - Wg, one_gate),
                down_telescoping_error=relative_error(Wd_k - Wd, one_down), block_error=relative_error(out, target))


def appendix_e_stable(model, prompt_ids: list, layer: int = 0) -> dict:
    """Case 2 (stable Gemma variant, float64): ``W_down`` steps towards successive inverted targets; ``dm`` steps with
    the fixed element-wise preconditioner ``N(h_target,n)`` telescope to the one-shot ``dm``; a moving one does not."""
    ad, T = _growing_contexts(model, prompt_ids, layer)
    P = ad.parts[layer]
    if P.kind != "scale":
        raise ValueError(f"appendix_e_stable needs a post-norm-scale block (Gemma 2/3); {ad.family.key} has "
                         f"{P.kind}")
    zC, v0 = T[-1].z.double(), T[0].v.double()
    mlp = P.mlp
    Wd = mlp.down_proj.weight.double()
    h_g = mlp.act_fn(mlp.gate_proj.weight.double() @ zC) * (mlp.up_proj.weight.double() @ zC)  # hidden after input patches
    h_down = Wd @ h_g
    m = ad.family.scale_offset + P.output.weight.double()
    eps = P.output.eps
    Nd = _norm(h_down, eps)
    C0 = float(h_down.pow(2).mean().sqrt())
    gs = [(T[k].v.double() - v0) + m * Nd for k in range(len(T))]
    targets = [invert_rmsnorm(g, m, C0)[0] for g in gs]
    rems = [g - m * _norm(t, eps) for g, t in zip(gs, targets)]
    pre = _norm(targets[-1], eps)                                          # fixed preconditioner N(h_target,n)
    # step 0 starts from (h_down, r = 0): with eps in the norm, even the empty context leaves a tiny r_0 != 0
    prev_t, prev_r = [h_down] + targets[:-1], [torch.zeros_like(m)] + rems[:-1]
    Wd_k, dm_fixed, dm_moving = Wd.clone(), torch.zeros_like(m), torch.zeros_like(m)
    for k in range(len(T)):
        D = torch.outer(targets[k] - prev_t[k], h_g) / float(h_g @ h_g)
        Wd_k = unit_trace_step(Wd_k, D)
        dm_fixed = dm_fixed + (rems[k] - prev_r[k]) / pre
        dm_moving = dm_moving + (rems[k] - prev_r[k]) / _norm(targets[k], eps)
    one_down = torch.outer(targets[-1] - h_down, h_g) / float(h_g @ h_g)
    one_dm = rems[-1] / pre
    out = v0 + (m + dm_fixed) * _norm(Wd_k @ h_g, eps)
    return dict(family=ad.family.key, layer=layer, n_context=len(T) - 1,
                r0_norm=float(rems[0].norm()), h_target0_error=relative_error(targets[0], h_down),
                down_telescoping_error=relative_error(Wd_k - Wd, one_down),
                dm_fixed_error=relative_error(dm_fixed, one_dm), dm_moving_error=relative_error(dm_moving, one_dm),
                block_error=relative_error(out, T[-1].out.double()))
