"""Independent reference implementations of the paper methods (imports nothing from dpfl).

Written from the papers' pseudo-code as the project's docs/algorithms.md states it
(§1–§7), one plain round loop with each method's local rule and server rule spelled
out. Public randomness is passed in (see ``tests/reference/common.py``):

* ``cohorts[t]``: client ids of round t;
* ``orders(t, i)``: an iterator of shuffled index arrays of client i's examples
  (one per pass over its data);
* ``noise(t)``: d standard normal draws, the round's central Gaussian noise ξ_t
  (the aggregate gets σ·C·ξ_t);
* ``randk_mask(t)``: the round's public rand-k mask (Fed-SMP);
* ``count_noise(t)``: one standard normal draw, the noise of adaptive clipping's
  released count in round t;
* ``client_noise(t, i)``: d standard normal draws of client i (client-site noise,
  and the paper's per-client-noise form of DP-FedSAM-top_k).

Where dpfl departs from a paper for privacy, the paper's form is available here as an
option (``topk_site="paper"``, ``noise_on="support"``, ``pgn_clip="median"``,
``clip_scope="tensor"``, ``count_centred=False``, ``weighting="examples"``), so the
tests can pin the departure; the form dpfl implements is the other option.

Privacy: this is test code and releases nothing. Its paper-form options are NOT
differentially private as written (noise only on a data-dependent support reveals the
support; a median clip norm taken from the client's own update makes the sensitivity
and the noise scale functions of private data; per-tensor clipping lets one client move
the sum by up to C·√(#tensors) while the noise is sized for C; per-client top-k after
per-client noise is private only at σ/√m); they exist only to measure dpfl's departures from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tests.reference.common import (
    DT,
    SGD,
    Problem,
    ce_loss,
    clip,
    flat,
    grad,
    minibatches,
    norm,
    shapes,
    smooth,
    top_k_mask,
    unflat,
)

PRIVATE = {
    "dp_fedavg",
    "dp_fedavg_blur",
    "dp_fedavg_blur_lus",
    "fedsmp_randk",
    "fedsmp_topk",
    "dp_fed_ls",
    "dp_fedsam",
    "dp_fedsam_topk",
    "dp2_fedsam",
    "dp_fedpgn",
    "dp_fedpgn_ls",
}
SAM_METHODS = {"fedsam", "dp_fedsam", "dp_fedsam_topk", "dp2_fedsam"}
PGN_METHODS = {"dp_fedpgn", "dp_fedpgn_ls"}


@dataclass
class Setting:
    """Hyperparameters of one reference run (names follow docs/algorithms.md)."""

    method: str
    model: str = "logreg"
    rounds: int = 3
    lr: float = 0.1  # η
    lr_decay: float = 1.0  # η_t = η·decay^t
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 4
    epochs: int = 1
    steps: int | None = None  # K local steps (PGN: required)
    server_lr: float = 1.0  # γ (PGN: γ·η·K is the step)
    clip: float = math.inf  # C
    z: float = 0.0  # σ, noise multiplier
    denominator: float | None = None  # q·N or m; None: realised cohort (FedAvg)
    rho: float = 0.0
    asam: bool = False
    blur_lambda: float = 0.0
    sparsity: float = 0.5  # kept fraction (top-k, rand-k), zeroed fraction c (LUS)
    randk_rescale: bool = False
    sigma_ls: float = 0.0
    ls_scope: str = "tensor"
    topk_site: str = "server"  # server | client | paper (per client after noise)
    noise_on: str = "all"  # all | support (paper: noise only on the clients' masks)
    beta: float = 1.0
    noise_site: str = "server"  # server: one central draw; client: each adds σC/√m ξ_i
    clip_mode: str = "fixed"  # fixed C, or adaptive quantile clipping (Andrew et al. 2021)
    target_quantile: float = 0.5  # γ
    clip_lr: float = 0.2  # η_C
    count_stddev: float = 0.0  # σ_b of the released count
    count_centred: bool = True  # release Σ(b_i − ½) (sensitivity ½) or Σ b_i
    pgn_clip: str = "fixed"  # fixed C, or the paper's median of the client's layer norms
    clip_scope: str = "model"  # model: whole update to C; tensor: each tensor to C (paper code)
    weighting: str = "uniform"  # FedAvg: uniform mean, or n_i-weighted (McMahan 2017)
    head_steps: int | None = None
    body_steps: int | None = None
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------- local steps


def sam_direction(w, loss_fn, rho, asam, wrt):
    """∇F(w + e) with e = ρ g/‖g‖ (SAM) or ρ T_w² g/‖T_w g‖, T_w = |w| (ASAM); the
    perturbation and gradient are over the parameters ``wrt`` only."""
    g = grad(w, loss_fn, wrt)
    if rho == 0:
        return g
    if asam:
        t = [w[i].abs() for i in wrt]
        tg = [ti * gi for ti, gi in zip(t, g)]
        n = norm(tg)
        e = [rho * ti * tgi / (n + 1e-12) for ti, tgi in zip(t, tg)]
    else:
        n = norm(g)
        e = [rho * gi / (n + 1e-12) for gi in g]
    w_pert = list(w)
    for i, ei in zip(wrt, e):
        w_pert[i] = w[i] + ei
    return grad(w_pert, loss_fn, wrt)


def local_train(
    s: Setting,
    w0: list[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    idx: np.ndarray,
    orders: Callable[[], Iterator[np.ndarray]],
    lr: float,
    g_tilde: list[torch.Tensor] | None,
    head: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], int]:
    """Client i's local training from the global model w0; returns (w_K, K)."""
    w = [p.clone() for p in w0]
    n_params = len(w)

    def data_loss(b):
        xb, yb = x[np.sort(b)], y[np.sort(b)]
        return lambda p: ce_loss(p, xb, yb)

    if s.method == "dp2_fedsam":
        # personal head (last Linear) restored, τ_h SGD steps on it with φ fixed ...
        head_ids = [n_params - 2, n_params - 1]
        body_ids = list(range(n_params - 2))
        if head is not None:
            w[head_ids[0]], w[head_ids[1]] = head[0].clone(), head[1].clone()
        hs = s.head_steps or math.ceil(len(idx) / s.batch_size)
        opt = SGD(lr, s.momentum, s.weight_decay)
        steps = 0
        for b in minibatches(orders(), s.batch_size, 1, hs):
            g = grad(w, data_loss(b), head_ids)
            new = opt.step([w[i] for i in head_ids], g)
            for i, v in zip(head_ids, new):
                w[i] = v
            steps += 1
        # ... then τ_φ SAM steps on φ with h fixed.
        opt = SGD(lr, s.momentum, s.weight_decay)
        for b in minibatches(orders(), s.batch_size, s.epochs, s.body_steps or s.steps):
            g = sam_direction(w, data_loss(b), s.rho, s.asam, body_ids)
            new = opt.step([w[i] for i in body_ids], g)
            for i, v in zip(body_ids, new):
                w[i] = v
            steps += 1
        return w, steps

    pgn = s.method in PGN_METHODS
    opt = SGD(lr, 0.0 if pgn else s.momentum, 0.0 if pgn else s.weight_decay)
    steps = 0
    for b in minibatches(orders(), s.batch_size, s.epochs, s.steps):
        loss = data_loss(b)
        if s.method in ("dp_fedavg_blur", "dp_fedavg_blur_lus"):
            # BLUR: + (λ/2)·max(0, ‖w − x^t‖² − C²) on the whole flattened model
            def loss(p, base=loss):
                sq = sum(((pi - ai) ** 2).sum() for pi, ai in zip(p, w0))
                return base(p) + 0.5 * s.blur_lambda * torch.clamp(sq - s.clip**2, min=0.0)

        if s.method in SAM_METHODS:
            g = sam_direction(w, loss, s.rho, s.asam, list(range(n_params)))
        elif pgn:
            # δ = ρ g̃/‖g̃‖; g = β ∇F(x + δ) + (1 − β) g̃  (g̃ = 0 in round 0)
            if g_tilde is None:
                g = [s.beta * gi for gi in grad(w, loss)]
            else:
                n = norm(g_tilde)
                wp = [wi + s.rho * gt / (n + 1e-12) for wi, gt in zip(w, g_tilde)]
                g = [s.beta * gi + (1 - s.beta) * gt for gi, gt in zip(grad(wp, loss), g_tilde)]
        else:
            g = grad(w, loss)
        w = opt.step(w, g)
        if s.method == "dp_fed_ls":
            # project onto the ball ‖w − x^t‖ ≤ C after every local step
            dn = float(norm([wi - ai for wi, ai in zip(w, w0)]))
            if dn > s.clip:
                w = [ai + (wi - ai) * (s.clip / dn) for wi, ai in zip(w, w0)]
        steps += 1
    return w, steps


# ----------------------------------------------------------------------- rounds


def run(
    s: Setting,
    prob: Problem,
    init: list[np.ndarray],
    cohorts: list[np.ndarray],
    orders: Callable[[int, int], Iterator[np.ndarray]],
    noise: Callable[[int], np.ndarray],
    randk_mask: Callable[[int], np.ndarray] | None = None,
    client_noise: Callable[[int, int], np.ndarray] | None = None,
    count_noise: Callable[[int], float] | None = None,
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Run ``s.rounds`` rounds; returns (final flat global model, personal heads)."""
    x = torch.as_tensor(prob.x, dtype=DT)
    y = torch.as_tensor(prob.y)
    w = [torch.as_tensor(a, dtype=DT) for a in init]
    shp = shapes(s.model, prob.dim, prob.num_classes)
    d = sum(math.prod(t) for t in shp)
    private = s.method in PRIVATE
    heads: dict[int, list[torch.Tensor]] = {}
    head_mask = torch.zeros(d, dtype=torch.bool)
    if s.method == "dp2_fedsam":
        head_mask[d - math.prod(shp[-2]) - math.prod(shp[-1]) :] = True
    g_tilde: torch.Tensor | None = None  # PGN: previous noisy pseudo-gradient (public)
    # Adaptive clipping: the update noise multiplier z_Δ with 1/z² = 1/z_Δ² + 1/(2σ_b)²,
    # so that update and count together are accounted as one Gaussian with z.
    z_update = s.z
    clip_t = s.clip
    if s.clip_mode == "adaptive" and s.z > 0:
        z_update = (s.z**-2 - (2.0 * s.count_stddev) ** -2) ** -0.5
    s.extra["clip_norms"] = []
    for t in range(s.rounds):
        s.extra["clip_norms"].append(clip_t)
        unclipped = 0
        lr = s.lr * s.lr_decay**t
        x_t = flat(w)
        total = torch.zeros(d, dtype=DT)
        raw_sum = torch.zeros(d, dtype=DT)
        weight_sum = 0.0
        support = torch.zeros(d, dtype=torch.bool)  # union of the clients' masks
        mask_rk = None
        if s.method == "fedsmp_randk":
            mask_rk = torch.as_tensor(randk_mask(t), dtype=torch.bool)
        gt_list = None if g_tilde is None else unflat(g_tilde, w)
        cohort = [int(i) for i in cohorts[t]]
        k_used = s.steps or 0
        for i in cohort:
            idx = prob.client_train[i]
            w_i, k = local_train(
                s,
                w,
                x,
                y,
                idx,
                lambda i=i, t=t: orders(t, i),
                lr,
                gt_list,
                heads.get(i),
            )
            k_used = k
            delta = flat(w_i) - x_t
            if s.method == "dp2_fedsam":
                heads[i] = [w_i[-2].clone(), w_i[-1].clone()]  # the head stays here
                delta[head_mask] = 0.0
            if s.method in PGN_METHODS and g_tilde is not None:
                delta = delta + (1 - s.beta) * k * lr * g_tilde  # remove the public drift
            if s.method == "fedsmp_randk":
                delta = torch.where(mask_rk, delta, torch.zeros_like(delta))
                if s.randk_rescale:
                    delta = delta * (d / int(mask_rk.sum()))
            client_topk = s.method == "fedsmp_topk" or (
                s.method == "dp_fedsam_topk" and s.topk_site == "client"
            )
            if client_topk:  # top-k of |Δ| before clipping (data-dependent mask)
                m = top_k_mask(delta, s.sparsity)
                delta = torch.where(m, delta, torch.zeros_like(delta))
                support |= m
            if s.method == "dp_fedavg_blur_lus":
                # LUS: importance |∂f_i/∂w_j · Δ_j| at the local model, keep (1 − c)·d
                xb, yb = x[np.sort(idx)], y[np.sort(idx)]
                gl = flat(grad(w_i, lambda p, xb=xb, yb=yb: ce_loss(p, xb, yb)))
                m = top_k_mask(gl * delta, 1.0 - s.sparsity)
                delta = torch.where(m, delta, torch.zeros_like(delta))
                support |= m
            n_i = len(idx) if s.weighting == "examples" else 1.0
            raw_sum += n_i * delta
            weight_sum += n_i
            if not private:
                continue
            if s.pgn_clip == "median":
                # DP-FedPGN reference code: C_i = median of the client's own per-tensor
                # update norms, used as its clip norm and its noise scale (not private)
                sizes = [math.prod(t) for t in shp]
                c_i = float(np.median([float(v.norm()) for v in torch.split(delta, sizes)]))
                s.extra.setdefault("median_clip", []).append(c_i)
                xi_i = torch.as_tensor(client_noise(t, i), dtype=DT)
                total += clip(delta, c_i) + s.z * c_i / math.sqrt(s.denominator) * xi_i
                continue
            unclipped += int(float(delta.norm()) <= clip_t)
            if s.clip_scope == "tensor":
                # DP-FedSAM reference code: each tensor clipped to C on its own, noise
                # still sized for C (the update's norm can reach C·sqrt(#tensors))
                sizes = [math.prod(t) for t in shp]
                c = torch.cat([clip(v, clip_t) for v in torch.split(delta, sizes)])
            else:
                c = clip(delta, clip_t)
            s.extra.setdefault("deltas", []).append(delta.clone())
            s.extra.setdefault("clipped", []).append(c.clone())
            if s.method == "dp_fedsam_topk" and s.topk_site == "paper":
                # paper eq. 12: each client noises its clipped update, then keeps top-k
                m_den = s.denominator
                noisy = c + s.z * s.clip / math.sqrt(m_den) * torch.as_tensor(
                    client_noise(t, i), dtype=DT
                )
                c = torch.where(top_k_mask(noisy, s.sparsity), noisy, torch.zeros_like(noisy))
            elif s.noise_site == "client":
                # each of the m clients adds N(0, (σC)²/m) on the released coordinates
                xi_i = torch.as_tensor(client_noise(t, i), dtype=DT)
                if mask_rk is not None:
                    xi_i = torch.where(mask_rk, xi_i, torch.zeros_like(xi_i))
                xi_i = torch.where(head_mask, torch.zeros_like(xi_i), xi_i)
                c = c + z_update * clip_t / math.sqrt(s.denominator) * xi_i
            total += c
        if not private:
            avg = raw_sum / weight_sum if cohort else raw_sum
            w = unflat(x_t + s.server_lr * avg, w)
            continue
        xi = torch.as_tensor(noise(t), dtype=DT)
        if s.method == "fedsmp_randk":
            xi = torch.where(mask_rk, xi, torch.zeros_like(xi))  # public mask: noise on k
        if s.method == "dp2_fedsam":
            xi = torch.where(head_mask, torch.zeros_like(xi), xi)  # heads are not released
        if s.noise_on == "support":
            xi = torch.where(support, xi, torch.zeros_like(xi))
        client_site = s.noise_site == "client" or s.pgn_clip == "median"
        if (s.method == "dp_fedsam_topk" and s.topk_site == "paper") or client_site:
            xi = torch.zeros_like(xi)  # the clients added it
        v = (total + z_update * clip_t * xi) / s.denominator
        if s.clip_mode == "adaptive":
            # b̃ = (Σ b_i + N(0, σ_b²))/m (or centred: (Σ(b_i − ½) + N)/m + ½);
            # C ← C·exp(−η_C (b̃ − γ)), public post-processing of the release
            noise_b = s.count_stddev * float(count_noise(t))
            if s.count_centred:
                b = (unclipped - 0.5 * len(cohort) + noise_b) / s.denominator + 0.5
            else:
                b = (unclipped + noise_b) / s.denominator
            clip_t = clip_t * math.exp(-s.clip_lr * (b - s.target_quantile))
        if s.method == "dp_fedsam_topk" and s.topk_site == "server":
            v = torch.where(top_k_mask(v, s.sparsity), v, torch.zeros_like(v))
        if s.method == "dp_fed_ls":
            v = smooth(v, shp, s.sigma_ls, s.ls_scope)
        if s.method in PGN_METHODS:
            k_pub = s.steps if s.steps is not None else k_used
            if g_tilde is not None:
                v = v - (1 - s.beta) * k_pub * lr * g_tilde  # add the drift back
            g_new = -v / (lr * k_pub)
            if s.method == "dp_fedpgn_ls":
                g_new = smooth(g_new, shp, s.sigma_ls, s.ls_scope)
            g_tilde = g_new
            w = unflat(x_t - s.server_lr * lr * k_pub * g_new, w)
        else:
            w = unflat(x_t + s.server_lr * v, w)
    return flat(w).numpy(), {i: flat(h).numpy() for i, h in heads.items()}
