"""The model card (Markdown) logged on the parent MLflow run: every lineage fact of one registered model."""

from __future__ import annotations

from typing import Any

from lifecycle.tasks.eval.evaluate.metrics_text import WORDNET_VERSION, scale_of


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def model_card(*, name: str, version: str | None, run_id: str, prefect_flow_run_id: str, tags: dict[str, str],
               lineage: dict, stage_configs: dict[str, dict], metrics: dict[str, Any],
               promotion: dict[str, str], examples: list[dict]) -> str:
    """Markdown from the packaged model's lineage.json, the run's tags and metrics, and the promotion record."""
    L = [f"# Model card: {name}" + (f" version {version}" if version else ""), ""]
    L += ["## Provenance", "", "| fact | value |", "|---|---|"]
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
    raw = sorted({r["path"]: r for d in lineage["datasets"] for r in d.get("inputs", [])}.values(),
                 key=lambda r: r["path"])
    L += ["", "## Raw input files", "", "| path | bytes | sha256 |", "|---|---|---|"]
    L += [f"| `{r['path']}` | {r['bytes']} | `{r['sha256']}` |" for r in raw]
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
