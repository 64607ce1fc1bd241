"""Evaluation of the global model: accuracy/loss, and membership-inference AUC.

The membership-inference attack (DP-Fed-LS §6.4) thresholds the per-example loss:
members (examples some client trained on) tend to have lower loss than held-out
examples from the same distribution. Its AUC over equal numbers of both is
P(loss(non-member) > loss(member)) (+½ for ties); 0.5 means no leakage. The AUC is
a measurement on the released model, not a privacy guarantee.

Privacy of the outputs (README, "Privacy model"): :func:`evaluate` on the dataset's
global test set is public, since that set holds no data of the population's clients
(:mod:`engine.data`). The attack AUC reads clients' training and held-out examples,
so it is reported as ``mia_auc_nonprivate``, an operator diagnostic.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from engine.data.federated import FederatedDataset
from engine.privacy import rng as rngs

MIA_STREAM = 8
MIA_MAX_SAMPLES = 2000


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


#: Evaluation batch on the CPU: activations stay in cache (the FedAvg cnn on 10,000
#: 28×28 images, one thread, channels_last: 2.96-4.06 s at 256 against 4.86-4.91 s at
#: 1,000 and 5.2 s at 2,048); on an accelerator, large batches.
CPU_EVAL_BATCH = 256
DEVICE_EVAL_BATCH = 2048


@torch.no_grad()
def evaluate_sums(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int | None = None
) -> tuple[int, float, int]:
    """(number correct, summed cross-entropy, n) of ``model`` on (x, y).

    Sums, so that slices evaluated on different workers add up to the whole. Batches
    go to the model's device; ``batch_size`` defaults to :data:`CPU_EVAL_BATCH` there
    on the CPU, else :data:`DEVICE_EVAL_BATCH`.
    """
    was_training = model.training
    model.eval()
    device = _device_of(model)
    if batch_size is None:
        batch_size = CPU_EVAL_BATCH if device.type == "cpu" else DEVICE_EVAL_BATCH
    correct, loss, n = 0, 0.0, len(y)
    for s in range(0, n, batch_size):
        xb = torch.from_numpy(np.array(x[s : s + batch_size])).to(device)
        yb = torch.from_numpy(np.array(y[s : s + batch_size])).to(device)
        out = model(xb)
        loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train(was_training)
    return correct, loss, n


def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int | None = None
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    correct, loss, n = evaluate_sums(model, x, y, batch_size)
    return (correct / n, loss / n) if n else (math.nan, math.nan)


def eval_slices(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) slices of the test set, one per worker (same everywhere)."""
    bounds = np.linspace(0, n, max(1, parts) + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def combine_sums(parts: list[tuple[int, float, int]]) -> tuple[float, float]:
    """(accuracy, mean loss) from per-slice sums, added in slice order."""
    correct = sum(p[0] for p in parts)
    loss = 0.0
    for p in parts:
        loss += p[1]
    n = sum(p[2] for p in parts)
    return (correct / n, loss / n) if n else (math.nan, math.nan)


@torch.no_grad()
def per_example_loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    model.eval()
    device = _device_of(model)
    out = []
    for s in range(0, len(y), 2048):
        xb = torch.from_numpy(np.array(x[s : s + 2048])).to(device)
        yb = torch.from_numpy(np.array(y[s : s + 2048])).to(device)
        out.append(nn.functional.cross_entropy(model(xb), yb, reduction="none").cpu().numpy())
    model.train()
    return np.concatenate(out) if out else np.zeros(0)


def auc_lower_is_member(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> float:
    """AUC of the rule "lower score ⇒ member": P(nonmember > member) + ½ P(tie)."""
    m, n = len(member_scores), len(nonmember_scores)
    if m == 0 or n == 0:
        return math.nan
    scores = np.concatenate([member_scores, nonmember_scores])
    order = scores.argsort(kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    rank_sum_nonmember = ranks[m:].sum()
    u = rank_sum_nonmember - n * (n + 1) / 2.0
    return float(u / (m * n))


def _all_indices(index) -> np.ndarray:
    """Every client's indices, client after client (a ClientIndex holds them so)."""
    flat = getattr(index, "flat", None)
    if flat is not None:
        return np.asarray(flat)
    return np.concatenate(list(index)) if len(index) else np.zeros(0)


def membership_inference_auc(model: nn.Module, dataset: FederatedDataset, seed: int) -> float:
    """Loss-threshold attack AUC on equal numbers of training and held-out examples.

    Not private: computed from clients' own data (the ``mia_auc_nonprivate`` column)."""
    members, held = _all_indices(dataset.client_train), _all_indices(dataset.client_test)
    k = min(len(members), len(held), MIA_MAX_SAMPLES)
    if k == 0:
        return math.nan
    g = rngs.numpy_rng(seed, MIA_STREAM)
    mem = np.sort(g.choice(members, k, replace=False))
    non = np.sort(g.choice(held, k, replace=False))
    lm = per_example_loss(model, dataset.x_train[mem], dataset.y_train[mem])
    ln = per_example_loss(model, dataset.x_train[non], dataset.y_train[non])
    return auc_lower_is_member(lm, ln)
