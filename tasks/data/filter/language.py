"""Language identification: py3langid, whose model ships in the package (fastText's lid.176, which datatrove's
LanguageFilter uses, is a download). Reason codes: lang_not_kept, lang_low_score.
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

from pydantic import Field

from lifecycle.tasks.data.filter.rule import Rule, Verdict


@lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


@lru_cache(maxsize=4)  # the stage detects each input text for its `lang` columns, then this rule asks again
def detect_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability in [0, 1]) from py3langid's bundled model (97 languages)."""
    lang, score = _identifier().classify(text.replace("\n", " "))
    return lang, float(score)


class LanguageConfig(Rule):
    """Keep documents in the listed languages, detected with enough confidence (datatrove LanguageFilter)."""

    uses_words: ClassVar[bool] = False

    languages: tuple[str, ...] | None = Field(("en",), description=(
        "Keep documents whose detected language (ISO 639-1) is one of these; null keeps every language (the "
        "language is still detected and stored). FineWeb: English only."))
    min_score: float | None = Field(0.65, ge=0, le=1, description=(
        "Drop documents whose language probability is below this. FineWeb / datatrove LanguageFilter "
        "(language_threshold): 0.65."))

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        lang, score = detect_language(text)
        if self.languages is not None and lang not in self.languages:
            return "lang_not_kept", f"lang={lang} score={score:.3f}"
        if self.min_score is not None and score < self.min_score:
            return "lang_low_score", f"lang={lang} score={score:.3f}"
        return None
