"""Language identification: py3langid, whose model ships in the package (fastText's lid.176, which datatrove's
LanguageFilter uses, is a download). Reason codes: lang_not_kept, lang_low_score.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import numpy as np
from pydantic import Field

from lifecycle.core.fs import cache_dir
from lifecycle.tasks.data.filter.rule import Rule, Verdict, beyond, register


MODEL_ARRAYS = ("ptc", "pc", "nextmove", "nextmove_row", "out_feat")  # py3langid 0.4's model.npz.xz (modelio.py)


def unpacked_model() -> Path:
    """py3langid's bundled model, unpacked once per model file into this user's cache (`lifecycle.core.fs.cache_dir`):
    one `.npy` per array, and `classes.json`. Loading the package's LZMA-compressed npz cost every pool worker
    time and memory (docs/benchmarks.md, "Issue 25: 2.3 GB, the same mix at every size, and three fixes it
    found"); the unpacked arrays are mapped from the page cache instead, and every worker on the machine shares
    one copy of them instead of holding its own."""
    from py3langid.langid import MODEL_DIR, MODEL_FILE

    src = Path(MODEL_DIR) / MODEL_FILE
    st = src.stat()
    out = cache_dir() / f"py3langid-{st.st_size}-{st.st_mtime_ns}"
    if (out / "classes.json").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with lzma.open(src) as f, np.load(f, allow_pickle=False) as data:
            missing = set(MODEL_ARRAYS) - set(data.files)
            if missing:
                raise ValueError(f"{src}: py3langid model without {sorted(missing)}; is py3langid the pinned version?")
            for name in MODEL_ARRAYS:
                np.save(tmp / f"{name}.npy", np.ascontiguousarray(data[name]))
            (tmp / "classes.json").write_text(json.dumps(data["classes"].tolist()))
        os.rename(tmp, out)
    except OSError:
        if not (out / "classes.json").exists():  # not another process that unpacked it first: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    return out


@lru_cache(maxsize=1)
def _identifier():
    """py3langid's LanguageIdentifier over the memory-mapped arrays of `unpacked_model` (py3langid's own loader
    when the cache is not writable): its DFA walk indexes `nextmove` and `out_feat` item by item (a memoryview over
    the mapping, as fast as its own array.array), its scores take rows of `ptc`."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    try:
        d = unpacked_model()
    except OSError:  # no writable cache: the package's own loader
        return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    arr = {name: np.load(d / f"{name}.npy", mmap_mode="r") for name in MODEL_ARRAYS}
    flat = {name: memoryview(arr[name]).cast("B").cast(arr[name].dtype.char) for name in ("nextmove", "out_feat")}
    return LanguageIdentifier(arr["ptc"], np.array(arr["pc"]), json.loads((d / "classes.json").read_text()),
                              flat["nextmove"], flat["out_feat"], norm_probs=True, tk_row=arr["nextmove_row"].tolist())


@lru_cache(maxsize=4)  # the stage detects each input text for its `lang` columns, then this rule asks again
def detect_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability in [0, 1]) from py3langid's bundled model (97 languages)."""
    lang, score = _identifier().classify(text.replace("\n", " "))
    return lang, float(score)


@register("language", reasons=("lang_",), doc="Language ID (language.py).", order=10,
          warm=lambda: _identifier())
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
            return "lang_not_kept", f"lang={lang} not in {list(self.languages)}, score={score:.3f}"
        if self.min_score is not None and score < self.min_score:
            return "lang_low_score", f"lang={lang}, {beyond('score', score, '<', self.min_score)}"
        return None
