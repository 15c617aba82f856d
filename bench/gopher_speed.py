"""Gopher repetition and the filter stage, main's code paths against this branch's, in one run (issue 25).

    .venv/bin/python -m bench.gopher_speed [--mb 24] [--docs N]

On the real corpus of bench/real_corpus.py (built once under /tmp/real-corpus, as bench.real_pipeline does), one
process, one worker, cold caches on both sides:
- `split_words`: main's chunk rules (`main_rules()` below: no plain-chunk fast path, main's `_prefix_len`,
  `_suffix_len` and `_join_specials`) against today's;
- the n-gram counts: the string-based `top_ngram_chars_python` / `dup_ngram_chars_python` against the compiled
  ones (ngrams.py), on the same word lists;
- the Gopher repetition rule (`reason`, as the filter runs it) and the whole filter stage (`filter_table` with the
  rules of bench.real_pipeline), main's paths against today's.
Every verdict (reason and detail string), every count and the kept/rejected tables must be equal, or it fails.
Prints a table, then one JSON line: docs/s old and new and the speed-up of each, and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import time
from pathlib import Path

from lifecycle.tasks.data.filter import gopher_repetition as rep
from lifecycle.tasks.data.filter import words


# --------------------------------------------------------------------------------------------------
# main's versions of the chunk rules this branch short-cuts (frozen copies; also the reference of
# tests/data/test_split_words_fast.py)


def main_prefix_len(s: str) -> int:
    c = s[0]
    if s.startswith(".."):
        return len(s) - len(s.lstrip("."))
    if c in words._PREFIX_CHARS or words.unicodedata.category(c) == "So" or (c == "+" and not s[1:2].isdigit()):
        return 1
    return 3 if s.startswith("US$") else 2 if s.startswith(("C$", "A$")) else 0


def main_suffix_len(s: str) -> int:
    if s.endswith(".."):
        return len(s) - len(s.rstrip("."))
    return next((len(s) - p for p in range(max(0, len(s) - 4), len(s)) if words._is_suffix(s, p)), 0)


def main_join_specials(toks: list[str]) -> list[str]:
    spans = [(i, j) for i in range(len(toks)) for j in range(i + 2, min(len(toks), i + 6) + 1)
             if "".join(toks[i:j]) in words._AFFIX_SPECIALS]
    if not spans:
        return toks
    taken, chosen = set(), []
    for i, j in sorted(spans, key=lambda s: (s[0] - s[1], s[0])):
        if taken.isdisjoint(range(i, j)):
            taken.update(range(i, j))
            chosen.append((i, j))
    out, k = [], 0
    for i, j in sorted(chosen):
        out += toks[k:i] + list(words._SPECIALS["".join(toks[i:j])])
        k = j
    return out + toks[k:]


class PythonCounts:
    """The string-based n-gram counts behind the interface of ngrams.Ngrams (main's computation)."""

    def __init__(self, ws: list[str]):
        self.words = ws

    def top_chars(self, n: int) -> int:
        return rep.top_ngram_chars_python(self.words, n)

    def dup_chars(self, n: int) -> int:
        return rep.dup_ngram_chars_python(self.words, n)


@contextlib.contextmanager
def main_rules(ngrams: bool = True):
    """Inside: words.py splits with main's chunk rules (no fast path, no prefilters) and, with `ngrams`, Gopher
    repetition counts n-grams with the string-based functions. Caches are cleared on entry and exit."""
    saved = words._prefix_len, words._suffix_len, words._join_specials, words._WRAPPED, rep._ngram_counts
    words._prefix_len, words._suffix_len, words._join_specials = main_prefix_len, main_suffix_len, main_join_specials
    words._WRAPPED = words.re.compile("(?!)")  # matches nothing: no fast path
    if ngrams:
        rep._ngram_counts = PythonCounts
    clear()
    try:
        yield
    finally:
        words._prefix_len, words._suffix_len, words._join_specials, words._WRAPPED, rep._ngram_counts = saved
        clear()


def clear() -> None:
    """Cold caches: the chunk cache and the last-split memo."""
    words._split_chunk.cache_clear()
    words._last_split = (None, [])


# --------------------------------------------------------------------------------------------------


def load(mb: float, n: int | None) -> list[str]:
    from bench.real_pipeline import corpus

    src, _ = corpus(Path("/tmp/real-corpus"), mb)
    texts: list[str] = []
    for path in sorted(src.glob("part-*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts[:n] if n else texts


def table(texts: list[str]):
    """The collect stage's table of these texts (what filter_table reads)."""
    import pyarrow as pa

    from lifecycle.core.dataset import DOC_SCHEMA

    n = len(texts)
    return pa.table({"doc_id": [f"d{i}" for i in range(n)], "source_id": [f"s{i}" for i in range(n)],
                     "text": texts, "source": ["real"] * n, "url": [None] * n, "meta": ["{}"] * n}, schema=DOC_SCHEMA)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run(texts: list[str]) -> dict:
    from lifecycle.tasks.data.filter.ngrams import Ngrams
    from lifecycle.tasks.data.filter.stage import FilterConfig, filter_table
    from bench.real_pipeline import RULES

    Ngrams(["a", "b"] * 8).top_chars(2), Ngrams(["a", "b"] * 8).dup_chars(5)  # numba: load the cached kernels
    cfg = rep.GopherRepetitionConfig()
    fcfg = FilterConfig(rules=RULES)

    def split_all():
        clear()
        return [[t for c in x.split() for t in words._split_chunk(c)] for x in texts]

    def counts_all(make, wl):
        out = []
        for w in wl:
            g = make(w)
            out.append(([g.top_chars(n) for n in (2, 3, 4) if len(w) >= n], [g.dup_chars(n) for n in range(5, 11)]))
        return out

    def reason_all():
        clear()
        return [cfg.reason(x) for x in texts]

    def filter_all():
        clear()
        kept, rejected, stats = filter_table(table(texts), fcfg)
        return kept, rejected, (stats.rows_kept, dict(stats.rejected), dict(stats.counters), stats.bytes_out)

    def both(name, fn, *args):
        """fn under main's code paths, then under today's, each timed from a collected heap; results equal."""
        gc.collect()
        with main_rules():
            old, res[f"{name}_old"] = timed(fn, *args)
        gc.collect()
        new, res[f"{name}_new"] = timed(fn, *args)
        return old, new

    res: dict = {}
    w_old, w_new = both("split", split_all)
    assert w_old == w_new, "split_words differs from main's"
    del w_old
    gc.collect()
    with main_rules():
        c_old, res["ngrams_old"] = timed(counts_all, PythonCounts, w_new)
    gc.collect()
    c_new, res["ngrams_new"] = timed(counts_all, Ngrams, w_new)
    assert c_old == c_new, "n-gram counts differ from main's"
    del w_new
    v_old, v_new = both("gopher", reason_all)
    assert v_old == v_new, "Gopher repetition verdicts differ from main's"
    f_old, f_new = both("filter", filter_all)
    assert f_old[0].equals(f_new[0]) and f_old[1].equals(f_new[1]) and f_old[2] == f_new[2], "filter output differs"
    return res | {"kept": f_new[0].num_rows, "rejected_by_gopher_rep": sum(v is not None for v in v_new)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=24, help="corpus size (bench/real_corpus.py), default 24")
    ap.add_argument("--docs", type=int, default=None, help="only the first N documents")
    args = ap.parse_args(argv)
    texts = load(args.mb, args.docs)
    load0 = os.getloadavg()[0]
    r = run(texts)
    n = len(texts)
    out = {"bench": "gopher_speed", "docs": n, "mb": round(sum(map(len, texts)) / 1e6, 2), "kept": r["kept"],
           "rejected_by_gopher_rep": r["rejected_by_gopher_rep"], "identical": True}
    print(f"{n} documents, one process (docs/s per worker; cold caches on both sides)")
    print(f"{'step':<34}{'main s':>9}{'new s':>9}{'main docs/s':>13}{'new docs/s':>12}{'speed-up':>10}")
    for key, label in (("split", "split_words (every document)"), ("ngrams", "n-gram counts (2..4 top, 5..10 dup)"),
                       ("gopher", "Gopher repetition rule"), ("filter", "filter stage (real_pipeline rules)")):
        old, new = r[f"{key}_old"], r[f"{key}_new"]
        out[key] = {"old_s": round(old, 3), "new_s": round(new, 3), "old_docs_per_s": round(n / old, 1),
                    "new_docs_per_s": round(n / new, 1), "speedup": round(old / new, 2)}
        print(f"{label:<34}{old:>9.2f}{new:>9.2f}{n / old:>13.1f}{n / new:>12.1f}{old / new:>9.2f}x")
    out["load_avg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
