"""The model card (Markdown) logged on the parent MLflow run: every lineage fact of one registered model."""

from __future__ import annotations

from typing import Any

from lifecycle.tasks.eval.evaluate.metrics_text import HEADLINE, WORDNET_VERSION, scale_of


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


LIMITATIONS = (
    "Trained by lifecycle on the corpus below only: it knows that corpus's domain and nothing else, and no "
    "instruction tuning or safety training was done.",
    "The scores are on a held-out split of the same corpus (in-distribution); they say nothing of other text.",
    "Toxicity and bias figures count words in greedy generations: a screen, not an assessment.",
)


def data_funnel(stats_by_stage: dict[str, dict]) -> list[str]:
    """Markdown rows: per data stage, documents in, kept, rejected and the three most frequent reasons."""
    rows = ["| stage | documents in | kept | rejected | top reasons |", "|---|---|---|---|---|"]
    for stage, st in stats_by_stage.items():
        if not st or "rows_in" not in st:
            continue
        top = sorted((st.get("rejected_by_reason") or {}).items(), key=lambda kv: -kv[1])[:3]
        reasons = ", ".join(f"{k} {v:,}" for k, v in top)
        rows.append(f"| {stage} | {st['rows_in']:,} | {st.get('rows_kept', 0):,} | {st.get('rows_rejected', 0):,} "
                    f"| {reasons} |")
    return rows


def summary_lines(params: int | None, metrics: dict[str, Any], stats_by_stage: dict[str, dict],
                  raw_files: int) -> list[str]:
    """One paragraph: the model's size, its training and the data it saw."""
    counters = (stats_by_stage.get("tokenize") or {}).get("counters", {})
    collected = (stats_by_stage.get("collect") or {}).get("rows_in")
    size = f"A decoder of {params:,} non-embedding parameters" if params else "A decoder"
    steps = metrics.get("train_steps")
    parts = [f"{size}, trained for {steps} steps" if steps else size]
    if "tokens_train" in counters:
        parts.append(f"on {counters['tokens_train']:,} tokens of {counters.get('docs_train', 0):,} documents")
    if collected is not None:
        parts.append(f"kept from {collected:,} documents in {raw_files:,} raw files")
    return [", ".join(parts) + ".", ""]


def model_card(*, name: str, version: str | None, run_id: str, prefect_flow_run_id: str, tags: dict[str, str],
               lineage: dict, stage_configs: dict[str, dict], metrics: dict[str, Any],
               promotion: dict[str, str], examples: list[dict], stats_by_stage: dict[str, dict] | None = None,
               params: int | None = None, raw_list: str = "raw_inputs.json") -> str:
    """Markdown from the packaged model's lineage.json, the run's tags and metrics, the data stages' stats and the
    promotion record: summaries first; the raw files are counted here and listed in the artifact `raw_list`."""
    stats_by_stage = stats_by_stage or {}
    raw = sorted({r["path"]: r for d in lineage["datasets"] for r in d.get("inputs", [])}.values(),
                 key=lambda r: r["path"])
    L = [f"# Model card: {name}" + (f" version {version}" if version else ""), ""]
    L += summary_lines(params, metrics, stats_by_stage, len(raw))
    head = [f"{k} {_fmt(metrics[k])}" + (f" [{scale_of(k)}]" if scale_of(k) else "") for k in HEADLINE if k in metrics]
    if head:
        L += ["Held-out figures: " + "; ".join(head) + ".", ""]
    L += ["## Intended use and limitations", "", "A model of the lifecycle pipeline's run, for research on its data "
          "and training; not evaluated for use in products.", ""] + [f"- {x}" for x in LIMITATIONS]
    L += ["", "## Data: what was kept and why the rest was dropped", ""] + data_funnel(stats_by_stage)
    L += ["", "## Provenance", "", "| fact | value |", "|---|---|"]
    facts = [("MLflow parent run", run_id), ("Prefect flow run", prefect_flow_run_id),
             ("git commit", tags.get("lifecycle.git_commit", "")),
             ("config sha256", tags.get("lifecycle.config_sha256", "")),
             ("tokenizer sha256", lineage.get("tokenizer_sha256")),
             ("checkpoint", lineage.get("checkpoint_dir")), ("checkpoint step", lineage.get("checkpoint_step")),
             ("checkpoint marker sha256", lineage.get("checkpoint_marker_sha256"))]
    L += [f"| {k} | `{v}` |" for k, v in facts]
    L += ["", "## Datasets (token shards back to raw input)", "", "| stage | rows | sha256 | manifest |",
          "|---|---|---|---|"]
    L += [f"| {d['stage']} | {d['num_rows']} | `{d['sha256']}` | `{d['manifest']}` |" for d in lineage["datasets"]]
    L += ["", "## Raw input files", "", f"{len(raw):,} files, {sum(r['bytes'] for r in raw):,} bytes; each with its "
          f"path, size and sha256 in the artifact `{raw_list}` beside this card, and in `lifecycle lineage model "
          f"{name}/{version} --files`."]
    numeric = {k: v for k, v in sorted(metrics.items()) if isinstance(v, (int, float))}
    L += ["", "## Evaluation", "", f"Evaluation set sha256: `{tags.get('lifecycle.eval_set_sha256', 'not recorded')}`",
          "", "| metric | value | scale |", "|---|---|---|"]
    L += [f"| {k} | {_fmt(v)} | {scale_of(k) or ''} |" for k, v in numeric.items()
          if not k.startswith(("robust_", "tox_", "bias_"))]
    if "gen_meteor" in numeric:
        L += ["", f"METEOR synonyms: {WORDNET_VERSION}."]
    for title, prefix in (("Robustness (held-out text and prompts, clean vs perturbed)", "robust_"),
                          ("Toxicity of generations (alt-profanity-check)", "tox_"),
                          ("Bias of generations (attribute-word counts per group)", "bias_")):
        rows = [(k, v) for k, v in numeric.items() if k.startswith(prefix)]
        if rows:
            L += ["", f"### {title}", "", "| metric | value | scale |", "|---|---|---|"]
            L += [f"| {k} | {_fmt(v)} | {scale_of(k) or ''} |" for k, v in rows]
    if promotion:
        L += ["", "## Promotion (alias `champion`)", ""]
        L += [f"- {k}: {v}" for k, v in promotion.items()]
    if examples:
        L += ["", "## Generated continuations of held-out prompts (greedy)", ""]
        for e in examples[:3]:
            L += [f"**{e['source_id']}**", "", f"- prompt: `{e['prompt']!r}`", f"- reference: `{e['reference']!r}`",
                  f"- generated: `{e['generated']!r}`", ""]
    L += ["", "## Stage configs", ""]
    for stage, cfg in stage_configs.items():
        L += [f"- **{stage}**: `{cfg}`"]
    return "\n".join(L) + "\n"
