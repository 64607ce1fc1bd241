"""The page: the CPU-scale table, the defaults review, the real-data parity, the
real scale's section (untuned: labelled so, pointing to the leaderboard) and the
ablations, assembled from the prose in ``text/``; and splicing one section into a page
without touching the rest."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from engine.config.presets import Preset
from scripts.fidelity import ROOT
from scripts.fidelity.ablation import ABLATIONS, ablation_table, title
from scripts.fidelity.runs import setting_summary
from scripts.fidelity.stats import combine, paired, reverses
from scripts.fidelity.text import lines as text_lines
from scripts.fidelity.text import mapping
from scripts.fidelity.verdicts import numbers

#: Where scripts/fashion_mnist_parity.py's results are read from (``--out`` there).
REAL_PARITY = ROOT / "results" / "fm_parity" / "parity.json"
REAL_HEADING = "## Real scale, untuned (Fashion-MNIST at the papers' client counts and rounds)"
#: The heading pages written before the relabelling carry (replaced when spliced).
OLD_REAL_HEADINGS = ("## Real scale (Fashion-MNIST at the papers' client counts and rounds)",)


def _cell(x: float) -> str:
    return f"{x:+.3f}" if not math.isnan(x) else "n/a"


def real_row(preset: Preset, rows: pd.DataFrame, meta: dict[str, Any], cpu: str) -> tuple[str, str]:
    """The table row of one run claim and its verdict."""
    name = Path(preset.path).name
    rule = preset.meta.get("verdict") or {}
    stats = paired(preset, rows)
    verdict_real = combine([s["verdict"] for s in stats])
    diffs = []
    for st in stats:
        e = st["epsilon_target"]
        where = f"ε={e:g}: " if 0 < e < math.inf else ""  # inf: rows not private
        diffs.append(
            f"{where}{_cell(st['mean'])} [{_cell(st['lo'])}, {_cell(st['hi'])}] ({st['verdict']})"
        )
    flip = "**yes**" if reverses(cpu, verdict_real) else "no"
    wall = f"{meta['wall_s'] / 60:.1f} min ({meta['runs']} runs"
    wall += f", load {meta['load_start']:.1f} → {meta['load_end']:.1f}"
    wall += ", resumed)" if meta.get("resumed") else ")"
    private = rows[rows["private"].astype(bool)]
    private = private.assign(epsilon_target=private["epsilon_target"].fillna(-1.0))
    cells = []
    for (e, alg), g in private.groupby(["epsilon_target", "algorithm"], sort=True):
        where = f" at {e:g}" if e > 0 else ""
        cells.append(f"{alg}{where}: {g['epsilon'].max():.7g}")
    spent = "; ".join(cells) or "not private"
    shown = numbers(rows, preset).split(" (accountant ε")[0]  # ε has its own column
    line = (
        f"| {preset.claim} | `{name}` | {setting_summary(preset)} | {shown} | "
        f"{rule['better']} − {rule['than']}: {'; '.join(diffs)} | {verdict_real} "
        "(one untuned setting) | "
        f"{spent} | {wall} | {cpu} | {flip} |"
    )
    return line, verdict_real


def real_section(
    done: list[tuple[Preset, pd.DataFrame, dict[str, Any]]],
    skipped: list[tuple[Preset, str]],
    cpu: dict[str, str],
    seeds: list[int],
) -> list[str]:
    """The page's real-scale section (issue 28 item 4)."""
    lines = [REAL_HEADING, "", *text_lines("real_untuned"), "", *text_lines("real_rule"), ""]
    if not done:
        return [*lines, "Not yet run."]
    lines += [
        *text_lines("real_runs", seeds=", ".join(map(str, seeds))),
        "",
        "| claim | preset | setting (real scale) | rows, mean ± sd | difference, mean "
        "[95 % interval] | outcome (one untuned setting, not a verdict) | accountant ε | "
        "wall time of the claim | "
        "CPU-scale verdict | reverses the CPU-scale verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for preset, rows, meta in done:
        stem = Path(preset.path).stem
        lines.append(real_row(preset, rows, meta, cpu.get(stem, "—"))[0])
    for preset, why in skipped:
        stem = Path(preset.path).stem
        lines.append(
            f"| {preset.claim} | `{stem}.yaml` | — | — | — | {why} | — | — | "
            f"{cpu.get(stem, '—')} | — |"
        )
    real_notes = mapping("real_notes")
    notes = [
        (p, real_notes[Path(p.path).stem]) for p, _, _ in done if Path(p.path).stem in real_notes
    ]
    if notes:
        lines += ["", "Notes:", ""]
        lines += [f"* `{Path(p.path).stem}`: {text}" for p, text in notes]
    lines += ["", "Commands (one claim at a time, in the background):", ""]
    for preset, _, meta in done:
        stem = Path(preset.path).stem
        lines.append(
            f"* `{stem}`: `nice -n 19 python -m scripts.fidelity --scale real --only {stem} "
            f"--seeds {','.join(map(str, meta['seeds']))}` — finished {meta['finished_utc']}, "
            f"randomness {', '.join(meta.get('randomness') or ['?'])}."
        )
    return lines


def splice_section(
    page: str, heading: str, section: list[str], formerly: tuple[str, ...] = ()
) -> str:
    """``page`` with the section under ``heading`` (or one of its ``formerly`` names; to
    the next ``## `` heading) replaced by ``section``; appended when the page has none.
    Nothing else changes."""
    lines = page.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() in (heading, *formerly))
    except StopIteration:
        return page.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = lines[end:]
    body = [*lines[:start], *section, *([""] if tail else []), *tail]
    return "\n".join(body).rstrip("\n") + "\n"


def section_of(page: str, heading: str, formerly: tuple[str, ...] = ()) -> list[str] | None:
    """The lines of ``page``'s section under ``heading`` (or one of its ``formerly``
    names; without the blank line before the next heading), or None."""
    lines = page.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() in (heading, *formerly))
    except StopIteration:
        return None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = lines[start:end]
    while body and not body[-1].strip():
        body.pop()
    return body


def real_parity_section(path: Path) -> list[str]:
    """Issue 28's real-data parity (scripts/fashion_mnist_parity.py's parity.json)."""
    lines = [*text_lines("real_parity_intro"), ""]
    if not path.is_file():
        return [*lines, "Not yet run."]
    res = json.loads(path.read_text())
    lines += [
        "| seed | plain loop | dpfl | dpfl − plain | ε plain / dpfl | wall s plain / dpfl "
        "(1-min load at the plain run's end, 2 shared cores) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["seeds"]:
        p, q = r["plain"], r["dpfl"]
        lines.append(
            f"| {r['seed']} | {p['test_accuracy']:.4f} | {q['test_accuracy']:.4f} | "
            f"{q['test_accuracy'] - p['test_accuracy']:+.4f} | {p['epsilon']:.3f} / "
            f"{q['epsilon']:.3f} | {p['wall_time_s']:.0f} / {q['wall_time_s']:.0f} "
            f"({p['loadavg']:.1f}) |"
        )
    lo, hi = res["difference_ci95"]
    lines += [
        "",
        f"Mean over seeds {', '.join(str(r['seed']) for r in res['seeds'])}: plain loop "
        f"{res['plain_mean']:.4f}, dpfl {res['dpfl_mean']:.4f}; difference "
        f"{res['difference_mean']:+.4f}, 95 % interval [{lo:+.4f}, {hi:+.4f}]. "
        f"Parity within 1 point: **{res['verdict']}**. The interval is wider than ±1 point:",
        *text_lines("real_parity_tail"),
    ]
    return lines


def render(results: list[tuple[Preset, str, str]], abl: dict[str, pd.DataFrame], meta: str) -> str:
    """The whole page (the real scale's section empty: ``--scale real`` fills it)."""
    lines = [
        *text_lines("header"),
        "",
        meta,
        "",
        "| paper claim | preset | scale | dpfl (final accuracy) | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for preset, scale_numbers, scale_verdict in results:
        name = Path(preset.path).name
        claim = f"{preset.paper}, {preset.table}: {preset.claim}"
        lines.append(f"| {claim} | `{name}` | cpu | {scale_numbers} | {scale_verdict} |")
        lines.append(
            f"| (same) | `{name}` | paper | — | not yet run (needs the full data set; "
            "GPU-scale budget) |"
        )
    lines += [
        "",
        *text_lines("defaults_review"),
        "",
        *real_parity_section(REAL_PARITY),
        "",
        *real_section([], [], {}, []),
    ]
    for which, frame in abl.items():
        _, variants = ABLATIONS[which]
        lines += ["", *title(which), "", *ablation_table(frame, variants)]
    return "\n".join(lines) + "\n"
