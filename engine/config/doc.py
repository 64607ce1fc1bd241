"""One line of documentation per config key, and the commented YAML of ``dpfl config``.

:func:`key_help` (:data:`KEY_HELP`, and the ``algo.*`` keys as their pieces declare them
in :mod:`algorithms.registry`) is the single place the command line takes key
descriptions from (``dpfl config``, ``dpfl run --help``); a test checks it covers every key of
:class:`engine.config.RunConfig`, so a new key without a description fails CI.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import yaml

from algorithms import registry
from engine.config.schema import RunConfig
from engine.config.sections import DEFAULT_EPSILON

#: Help of every key but the ``algo.*`` ones, which their pieces declare
#: (:func:`algorithms.registry.key_help`); :func:`key_help` holds both.
KEY_HELP: dict[str, str] = {
    "algorithm": "the recipe; one of `dpfl algorithms`, or custom (the recipe: section)",
    "seed": "all randomness derives from it (data, init, sampling, noise, batches)",
    "rounds": "number of rounds T",
    "out": "results folder (null: results/<timestamp>-<algorithm>); never overwritten",
    "callbacks": "import paths (module:name) of per-round callbacks: a class or function "
    "called with no argument, or an instance (copied per run); see docs/extending.md",
    "dataset.name": "synthetic, digits (sklearn 8x8, offline), mnist, fashion_mnist, emnist, "
    "cifar10, cifar100, svhn, femnist, shakespeare",
    "dataset.root": "folder holding the dataset files (null for synthetic; for fashion_mnist "
    "null is /usr/share/datasets/fashion-mnist, Debian's dataset-fashion-mnist)",
    "dataset.download": "let torchvision download missing files (online only)",
    "dataset.num_clients": "N; for natural partitions, the first N writers/roles",
    "dataset.partition": "iid, dirichlet, or natural (synthetic, femnist, shakespeare)",
    "dataset.alpha": "Dirichlet concentration over labels (small = skewed)",
    "dataset.client_test_fraction": "share of each client's data held out for personal eval "
    "(null: 0, or 0.2 for a personalised recipe or eval.membership_inference; config.json "
    "records the resolved value)",
    "dataset.emnist_split": "EMNIST split (byclass, bymerge, balanced, letters, digits, mnist)",
    "dataset.synthetic_model": "shared: one labelling rule for all clients (public clients "
    "too); per_client: Synthetic(alpha, beta) as published (public accuracy ~ chance)",
    "dataset.synthetic_alpha": "Synthetic(alpha, beta): model heterogeneity across clients",
    "dataset.synthetic_beta": "Synthetic(alpha, beta): data heterogeneity across clients",
    "dataset.synthetic_dim": "Synthetic: input dimension",
    "dataset.synthetic_classes": "Synthetic: number of classes",
    "dataset.synthetic_mean_samples": "Synthetic: mean client size (log-normal)",
    "dataset.materialize": "false: synthetic clients built on demand from (seed, client), "
    "nothing stored per client (needs partition natural)",
    "dataset.public_eval_clients": (
        "synthetic/LEAF: clients (writers) held out of the population as the public "
        "test set; null: ceil(N/10)"
    ),
    "dataset.validation_size": "> 0: that many training examples (drawn from the seed) no "
    "client holds, a public validation set (val_accuracy in dpfl leaderboard); iid or "
    "dirichlet partitions",
    "dataset.normalize": "image inputs: standardize (public per-channel constants) or "
    "unit_interval ([0, 1]); null: the source's recipe (unit_interval for mnist, "
    "fashion_mnist, emnist, femnist; standardize for cifar10, cifar100, svhn, digits), "
    "resolved when the config is loaded so config.json records it",
    "model.name": "logreg, mlp, cnn, resnet10_gn, resnet18_gn, char_lstm",
    "model.memory_format": "auto, contiguous or channels_last (conv layout; same maths)",
    "model.init": "default (PyTorch layer init from the seed) or zeros (logreg only)",
    "sampling.mode": "poisson (each client joins with prob. rate) or fixed (cohort_size)",
    "sampling.rate": "Poisson sampling probability q in (0, 1]",
    "sampling.cohort_size": "m clients per round for sampling.mode=fixed",
    "sampling.max_cohort": "hard cap on Poisson cohorts (truncated Poisson, PLD accountant)",
    "eval.every": "evaluate the global model every k rounds and at the last round",
    "eval.membership_inference": (
        "add the loss-threshold attack AUC (mia_auc_nonprivate) at the end"
    ),
    "eval.audit_canaries": "K > 0: K canary clients join the population; the run reports "
    "the one-shot empirical epsilon estimate (an estimate, not a guarantee)",
    "eval.audit_every_round": "audit with every round's released update, not only the final "
    "model's delta (correlated noise: the rounds whitened by the mechanism's own matrix)",
    "privacy.epsilon": "target epsilon, sigma calibrated to it (null with noise_multiplier "
    "null: 4)",
    "privacy.delta": "delta in (0, 1); null: min(N^-1.1, 0.01/N), N = dataset.num_clients",
    "privacy.noise_multiplier": "sigma (z); epsilon is computed. Give at most one of the two",
    "privacy.clip_norm": "C > 0: each client's update is clipped to this L2 norm",
    "privacy.secure_noise": "release mode: cohorts and noise from the OS CSPRNG, never "
    "recorded (false: seeded, reproducible simulation)",
    "privacy.clip_mode": "fixed (C = clip_norm) or adaptive (C_t follows a quantile of "
    "update norms; clip_norm is C_0)",
    "privacy.target_quantile": "adaptive clipping: target fraction gamma of unclipped updates",
    "privacy.clip_lr": "adaptive clipping: geometric step eta of C_t",
    "privacy.clip_count_stddev": "adaptive clipping: noise sigma_b of the released count "
    "(null: expected cohort / 20); needs z < 2 sigma_b",
    "privacy.accountant": "rdp or pld (null: rdp; pld when sampling.max_cohort is set)",
    "local.epochs": "local passes over the client's data",
    "local.steps": "if set, every client runs exactly this many minibatch steps",
    "local.batch_size": "local minibatch size",
    "local.lr": "local SGD learning rate",
    "local.lr_decay": "local lr at round t is lr * decay^t",
    "local.momentum": "local SGD momentum (fresh optimizer per client)",
    "local.weight_decay": "local SGD weight decay",
    "recipe.private": "algorithm=custom: clip to C and add calibrated noise (false: neither)",
    "recipe.regularizer": "algorithm=custom: null or blur (penalise updates longer than C)",
    "recipe.constraint": "algorithm=custom: null or ball (project onto the C-ball each step)",
    "recipe.noise_support": "algorithm=custom: all, or public_mask (rand-k's public mask only)",
    "recipe.personal": "algorithm=custom: personal heads kept on each client (DP2-FedSAM)",
    "server.lr": "server step: x <- x + lr * (noisy mean update)",
    "ray.executor": "ray (actors), processes (forked on this machine, no Ray) or local (in "
    "process); identical results",
    "ray.address": "attach to a running cluster, e.g. auto (null: start a local Ray)",
    "ray.num_workers": "client-worker actors (also the number of cohort shards)",
    "ray.num_cpus_per_worker": "CPUs per worker actor (fractions allowed)",
    "ray.num_gpus_per_worker": "GPUs per worker actor (fractions allowed)",
    "ray.object_store_memory_mb": "object store size of a local Ray (null: Ray's default)",
    "ray.clients_per_worker_batch": "vectorised clients per group (null: from memory; 1: none)",
    "ray.max_worker_restarts": "restarts granted to each worker and the server over the run",
    "ray.gpu_memory_safety": "fraction of free GPU memory kept spare by gpu_packing=memory",
    "ray.gpu_packing": "fixed (num_gpus_per_worker) or memory (measured workers per GPU)",
    "ray.worker_device": "auto (the GPU Ray assigned, else CPU), cpu or cuda",
    "ray.server": "where the server runs: auto (driver on a one-node cluster, else actor), "
    "actor or driver; same results",
    "ray.overlap_evaluation": "evaluate round t in each worker's second thread while round "
    "t+1 trains (executor=ray); same results",
}


def key_help() -> dict[str, str]:
    """One line of help per config key: :data:`KEY_HELP`, the registered pieces' keys,
    and the recipe: lists of transforms, which name the registered ones."""
    client = ", ".join(registry.names("client_transform"))
    server = ", ".join(registry.names("server_transform"))

    def named(kind: str, default: str) -> str:
        return f"algorithm=custom: {', '.join(registry.names(kind))} (null: {default})"

    return {
        **KEY_HELP,
        **registry.key_help(),
        "recipe.client_transforms": f"algorithm=custom: before clipping, any of {client}",
        "recipe.server_transforms": f"algorithm=custom: after the noise, any of {server}",
        "recipe.step": named("step", "sgd; a step may bring its method's pieces"),
        "recipe.server_step": named("server_step", "fedavg, or the step rule's own"),
        "recipe.noise": named("noise", "gaussian, independent every round"),
        "recipe.participation": named("participation", "sampled, the sampling: section"),
    }


def config_keys(config: RunConfig | None = None) -> dict[str, Any]:
    """Every leaf key of ``config`` (default: the defaults), dotted, with its value."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = value

    walk(config if config is not None else RunConfig(), "")
    return out


def _line(indent: str, key: str, value: Any, help_text: str) -> str:
    text = yaml.safe_dump({key: value}, default_flow_style=False, allow_unicode=True).rstrip()
    return f"{indent}{text}  # {help_text}"


def commented_yaml(config: RunConfig | None = None) -> str:
    """``config`` (default: the defaults) as YAML, one ``# comment`` per key.

    The text loads back (``yaml.safe_load``, then :func:`engine.config.config_from_dict`)
    to the same config, so it can be saved and edited as a ``--config`` file."""
    config = config if config is not None else RunConfig()
    lines = [
        "# dpfl configuration (dpfl config). A --config file is a diff over these",
        "# defaults; dpfl run --set KEY=VALUE overrides one key, e.g. --set local.lr=0.1.",
    ]
    section = None
    help_text = key_help()
    keys = config_keys(config)
    if keys["privacy.epsilon"] == DEFAULT_EPSILON and keys["privacy.noise_multiplier"] is None:
        keys["privacy.epsilon"] = None  # the default; null so that setting sigma alone works
    for dotted, value in keys.items():
        head, _, leaf = dotted.rpartition(".")
        if head != section:
            if head:
                lines.append(f"{head}:")
            section = head
        lines.append(_line("  " if head else "", leaf, value, help_text.get(dotted, "")))
    return "\n".join(lines) + "\n"


def keys_epilog() -> str:
    """The config keys, grouped by section, for ``dpfl run --help``."""
    groups: dict[str, list[str]] = {}
    for dotted in config_keys():
        head, _, leaf = dotted.rpartition(".")
        groups.setdefault(head, []).append(leaf)
    lines = ["config keys (--set KEY=VALUE, or a YAML --config file):"]
    for head, leaves in groups.items():
        text = f"{head}.{{{', '.join(leaves)}}}" if head else ", ".join(leaves)
        lines += textwrap.wrap(text, 78, initial_indent="  ", subsequent_indent="      ")
    lines.append("`dpfl config` prints every key with its default and meaning;")
    lines.append("docs/reference/config.md (the site's Configuration keys) lists them all.")
    return "\n".join(lines)


def undocumented_keys() -> list[str]:
    """The config keys without a line of help (:func:`key_help`): the configuration
    reference (``docs/reference/config.md``, generated) would show them bare. A key
    added to the tree, e.g. by a newly registered piece, is listed here until its
    declaration says what it does."""
    helps = key_help()
    return [key for key in config_keys() if not helps.get(key, "").strip()]
