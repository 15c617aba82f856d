"""Quality filter: an ordered list of rules, each one module with its own config section (datatrove's
`pipeline/filters/`, one file per rule family; `examples/fineweb.py` is the ordered list).

    filter:
      rules: [language, gopher_repetition, gopher_quality, c4, fineweb]   # FineWeb's order
      gopher_quality: {min_doc_words: 50}                                 # any field of any section

A document is rejected with the reason of the first listed rule it fails; a rule that is not listed is not
applied (its section is ignored). Rules, their sections and reason codes:
- `language` (language.py): py3langid language ID; lang_not_kept, lang_low_score;
- `gopher_repetition` (gopher_repetition.py): Gopher duplicate lines, paragraphs, n-grams; gopher_dup_*, gopher_top_*;
- `gopher_quality` (gopher_quality.py): Gopher word count, word length, symbols, bullets, stop words; gopher_*;
- `c4` (c4.py): C4 line and document rules; c4_*. Its kept lines replace the text for the rules after it;
- `fineweb` (fineweb.py): FineWeb line rules; fineweb_*;
- `code` (code.py): Codex / BigCode basic filter for source files (line lengths, alphanumeric share,
  auto-generated); code_*.
Default: language ID then Gopher quality. Gopher repetition, C4 and FineWeb are opt-in because on short, curated
text such as the demo corpus they drop most documents; deploy/configs/fineweb.yaml lists FineWeb's full set.
Kept rows gain `lang` and `lang_score` columns: py3langid's answer for the input text, whether or not `language`
is listed. Evaluation is lazy (issue 25): the rules stop at the first failure, and language ID runs only on the
documents that reach the `language` rule and on the kept ones.
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from lifecycle.core.dataset import (
    StageStats, rejected_table,
)
from lifecycle.core.shards import PerFileStage, map_tables
from lifecycle.tasks.data.filter.language import LanguageConfig, detect_language
from lifecycle.tasks.data.filter.rule import Rule, Verdict, load_rules
from lifecycle.tasks.data.filter.words import split_words

NAME = "filter"
RULES = load_rules()  # every rule module of this package registers itself (rule.register)
RuleName = Literal[tuple(RULES)]  # type: ignore[valid-type]  # the registered names


class _Filter(BaseModel):
    """Which rules run, in which order, and each rule's own section (one field per registered rule)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("rules", check_fields=False)
    @classmethod
    def _once(cls, rules: tuple[str, ...]) -> tuple[str, ...]:
        twice = sorted({r for r in rules if rules.count(r) > 1})
        if twice:
            raise ValueError(f"lists {', '.join(twice)} more than once")
        return rules

    def active(self) -> list[Rule]:
        """The listed rules' sections, in order."""
        return [getattr(self, name) for name in self.rules]  # type: ignore[attr-defined]


FilterConfig = create_model(  # type: ignore[call-overload]
    "FilterConfig", __base__=_Filter, __module__=__name__,
    rules=(tuple[RuleName, ...], Field(("language", "gopher_quality"), description=(  # type: ignore[valid-type]
        "The rules to apply, in order; a document's reason is the first it fails. Default: language ID, then "
        "Gopher quality. FineWeb (datatrove examples/fineweb.py): language, gopher_repetition, gopher_quality, "
        "c4, fineweb."))),
    **{name: (info.config, Field(info.config(), description=info.doc)) for name, info in RULES.items()})

# reason code prefix -> the rule that gives it, longest first (gopher_dup_ before gopher_: both Gopher rules use it)
REASON_PREFIXES = tuple(sorted(((p, name) for name, info in RULES.items() for p in info.reasons),
                               key=lambda pr: -len(pr[0])))


def rule_of(reason: str) -> str:
    """The rule (a `filter.rules` name) whose check gave reason code `reason`; the code itself if none did."""
    return next((rule for prefix, rule in REASON_PREFIXES if reason.startswith(prefix)), reason)


def document_verdict(text: str, cfg: FilterConfig) -> tuple[Verdict, str, str | None, float | None]:
    """(first failing rule as (reason, detail) or None, text as the rules left it, lang, lang_score).

    Lazy: the rules run in the configured order and stop at the first failure, and language ID (the costliest
    step) runs only when the `language` rule is reached or the document is kept (its `lang` columns). A rejected
    document's lang and lang_score are None unless the `language` rule ran on it."""
    original, lang_ran = text, False
    words, words_of = None, None  # split when a rule first needs them, again after an edit or for another view
    for rule in cfg.active():
        seen = rule.judged(text)  # the text itself, or without its markup lines (skip_markup_lines)
        if rule.uses_words and (words is None or words_of != seen):
            words, words_of = split_words(seen), seen
        lang_ran = lang_ran or isinstance(rule, LanguageConfig)
        if v := rule.reason(seen, words if words_of == seen else None):
            lang, score = detect_language(original) if lang_ran else (None, None)
            return v, text, lang, score
        if (new := rule.edit(text)) != text:
            text, words, words_of = new, None, None
    lang, score = detect_language(original)  # the input text's language, as before any rule edited it
    return None, text, lang, score


def filter_table(table: pa.Table, cfg: FilterConfig) -> tuple[pa.Table, pa.Table, StageStats]:
    """(kept rows, rejected rows, stats). Kept rows keep the input columns (text as the rules left it: C4 removes
    lines) plus `lang` and `lang_score`; the first failing rule is the reason."""
    texts = table.column("text").to_pylist()
    doc_ids = table.column("doc_id").to_pylist()
    source_ids = table.column("source_id").to_pylist()
    keep: list[bool] = []
    out_texts, langs, scores = [], [], []
    rejected: list[dict] = []
    stats = StageStats(rows_in=table.num_rows)
    for doc_id, source_id, text in zip(doc_ids, source_ids, texts):
        if text is None:
            raise ValueError(f"{NAME}: row doc_id={doc_id!r} source_id={source_id!r} has a null text")
        size = len(text.encode("utf-8"))
        stats.bytes_in += size
        verdict, new_text, lang, score = document_verdict(text, cfg)
        keep.append(verdict is None)
        if verdict is None:
            out_texts.append(new_text)
            langs.append(lang)
            scores.append(score)
            stats.bytes_out += len(new_text.encode("utf-8"))
            if new_text != text:
                stats.counters["c4_lines_removed_docs"] += 1
        else:
            rejected.append({"doc_id": doc_id, "source_id": source_id, "reason": verdict[0], "detail": verdict[1]})
            stats.rejected[verdict[0]] += 1
    stats.rows_kept = sum(keep)
    kept = table.filter(pa.array(keep, type=pa.bool_())) if table.num_rows else table
    idx = kept.schema.get_field_index("text")
    kept = kept.set_column(idx, kept.schema.field(idx), pa.array(out_texts, pa.string()))
    kept = kept.append_column("lang", pa.array(langs, pa.string()))
    kept = kept.append_column("lang_score", pa.array(scores, pa.float32()))
    return kept, rejected_table(rejected, NAME), stats


# --------------------------------------------------------------------------------------------------
# stage entry (no Prefect, no MLflow)


def filter_shard(cfg: FilterConfig, files: list[str], writer) -> StageStats:
    return map_tables(files, writer, lambda table: filter_table(table, cfg))


def warm_filter(cfg: FilterConfig) -> None:
    """Load what every shard loads on its first document, once in the worker before its shard processes fork
    (`lifecycle.core.shards.warm_worker`), instead of once in each: each listed rule's `warm` (rule.register), and
    the language-ID model always, for the kept documents' `lang` columns."""
    for name in dict.fromkeys(("language", *cfg.rules)):  # type: ignore[attr-defined]
        if (warm := RULES[name].warm) is not None:
            warm()


STAGE = PerFileStage(NAME, __package__, filter_shard, warm=warm_filter)
run_filter = STAGE.run  # filter every kept file of a parent into a committed `filter` dataset, here
