"""PNG charts for the parent MLflow run: the document funnel and the loss curves (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from lifecycle.tasks.stages import DATA_STAGES


def preload() -> None:
    """Import matplotlib's pyplot (Agg) ahead of the first chart: the warm runner (lifecycle/launch.py) does it once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

FUNNEL_STAGES = DATA_STAGES
DUPLICATE_KIND_COUNTERS = {"duplicate_exact": "duplicate (exact)", "duplicate_near": "duplicate (near)",
                           "duplicate_simhash": "duplicate (near, simhash)",
                           "duplicate_paragraph": "duplicate (paragraphs, bloom)",
                           "duplicate_substring": "duplicate (substrings, suffix array)"}


def stage_notes(stage: str, manifest: dict) -> list[str]:
    """What a step did that drops no document, so that every data method shows in the funnel: the bytes paragraph
    and substring dedup cut, the score column a scoring step wrote, the eval sets a document was checked against."""
    counters = (manifest.get("stats") or {}).get("counters") or {}
    notes = []
    if counters.get("paragraphs_cut"):
        notes.append(f"cut {counters['paragraph_bytes_cut']:,} B: {counters['paragraphs_cut']:,} paragraphs (bloom)")
    if counters.get("substrings_cut"):
        notes.append(f"cut {counters['substring_bytes_cut']:,} B: {counters['substrings_cut']:,} spans (suffix array)")
    if manifest.get("score_column"):
        scored = counters.get("scored_docs", manifest["stats"].get("rows_kept", 0))
        notes.append(f"scored {scored:,} ({manifest['score_column']})")
    if stage == "decontaminate":
        notes.append("checked against " + ", ".join((manifest.get("config") or {}).get("sets", [])))
    return notes


def funnel_rows(manifests: dict[str, dict]) -> list[dict]:
    """[{stage, rows_in, rows_kept, top_reasons: [(reason, n), ...], notes: [...]}] in pipeline order, from
    manifests: the three commonest reasons of a stage, for filter the documents each rule dropped (its codes
    summed), and `stage_notes`."""
    out = []
    for stage in FUNNEL_STAGES:
        stats = (manifests.get(stage) or {}).get("stats")
        if not stats:
            continue
        reasons = dict(stats.get("rejected_by_reason", {}))
        kinds = {k: n for k, n in (stats.get("counters") or {}).items() if k in DUPLICATE_KIND_COUNTERS}
        if stage == "dedup" and kinds and sum(kinds.values()) == reasons.get("duplicate"):
            del reasons["duplicate"]  # one reason, shown split by kind: "duplicate (exact)", "duplicate (near)"
            reasons.update({DUPLICATE_KIND_COUNTERS[k]: n for k, n in kinds.items()})
        if stage == "filter":  # what each rule costs: its reason codes summed, every rule shown
            from lifecycle.tasks.data.filter.stage import rule_of

            by_rule: dict[str, int] = {}
            for reason, n in reasons.items():
                by_rule[rule_of(reason)] = by_rule.get(rule_of(reason), 0) + n
            reasons, shown = by_rule, len(by_rule)
        else:
            shown = 3
        reasons = sorted(reasons.items(), key=lambda kv: -kv[1])
        out.append({"stage": stage, "rows_in": stats["rows_in"], "rows_kept": stats["rows_kept"],
                    "top_reasons": reasons[:shown], "notes": stage_notes(stage, manifests[stage])})
    return out


def nice_bound(x: float) -> float:
    """The smallest 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7 or 8 times a power of ten that is >= x (2,130 -> 2,500)."""
    if x <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(x))
    return next(m * scale for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 10) if m * scale >= x * (1 - 1e-12))


def funnel_png(manifests: dict[str, dict], path: str | Path) -> Path:
    """Bars: raw records, then documents kept after each stage, each labelled with its top drop reasons."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = funnel_rows(manifests)
    if not rows:
        raise ValueError("no stage statistics to draw a funnel from")
    labels = ["raw records"] + [r["stage"] for r in rows]
    values = [rows[0]["rows_in"]] + [r["rows_kept"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    fig.subplots_adjust(left=0.12, right=0.6, top=0.88, bottom=0.13)  # the drop reasons go right of the axes;
    # left: room for the longest stage name (decontaminate)
    bars = ax.barh(labels[::-1], values[::-1], color="#4c72b0")
    notes = [""] + [textwrap.fill("; ".join([f"-{n:,} {k}" for k, n in r["top_reasons"]] + r["notes"]), 60)
                    for r in rows]  # wrapped: dedup's reasons and cuts run to two lines
    beside = matplotlib.transforms.blended_transform_factory(ax.transAxes, ax.transData)
    for bar, v, note in zip(bars, values[::-1], notes[::-1]):
        y = bar.get_y() + bar.get_height() / 2
        ax.text(bar.get_width(), y, f" {v:,}", va="center", fontsize=8)
        ax.text(1.02, y, note, va="center", fontsize=8, transform=beside, clip_on=False)
    ax.set_xlim(0, nice_bound(max(values) * 1.08))  # room for the count after the longest bar
    ax.set_xlabel("documents")
    ax.set_title("Document funnel (kept after each stage; top drop reasons, cuts and scores)", loc="left")
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_png(rows: list[dict], path: str | Path, final_val_loss: float | None = None,
             final_step: int | None = None) -> Path:
    """Training loss and in-training validation loss per step (metrics.jsonl rows), plus the final evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if not train:
        raise ValueError("no training loss rows to plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="val loss (during training)")
    if final_val_loss is not None and final_step is not None:
        ax.plot([final_step], [final_val_loss], "r*", markersize=12, label="val loss (evaluate)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
