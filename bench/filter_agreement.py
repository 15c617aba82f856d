"""Filter agreement: our keep/drop decisions vs datatrove 0.10.1's implementations of the same rules
(GopherRepetitionFilter, GopherQualityFilter, C4QualityFilter(filter_no_terminal_punct=False),
FineWebQualityFilter, chained in FineWeb's order) on the same documents: the bundled corpus. Our side runs the
filter section of the shipped deploy/configs/fineweb.yaml, without its language rule.

datatrove runs in its own venv (create it with `bench/make_dtvenv.sh`; path from $DTVENV, default /tmp/dtvenv).
Language ID is left out of the comparison: datatrove's LanguageFilter needs fastText's lid.176 model, a download.

Run: `.venv/bin/python -m bench.filter_agreement`
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from lifecycle.config import load_config
from lifecycle.tasks.data.filter.stage import document_verdict

ROOT = Path(__file__).resolve().parents[1]
CORPUS = sorted((ROOT / "corpus" / "python-docs").glob("*.jsonl.gz"))
FINEWEB_CONFIG = ROOT / "deploy" / "configs" / "fineweb.yaml"
DTVENV = Path(os.environ.get("DTVENV", "/tmp/dtvenv"))

DATATROVE_SCRIPT = r"""
import json, sys
from datatrove.data import Document
from datatrove.pipeline.filters import GopherRepetitionFilter, GopherQualityFilter, C4QualityFilter, FineWebQualityFilter
filters = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(filter_no_terminal_punct=False),
           FineWebQualityFilter()]
out = []
for line in open(sys.argv[1]):
    doc = Document(text=json.loads(line)["text"], id="x")
    verdict = None
    for f in filters:
        r = f.filter(doc)
        if r is not True and not (isinstance(r, tuple) and r[0]):
            verdict = f"{type(f).__name__}:{r[1] if isinstance(r, tuple) else 'dropped'}"
            break
    out.append(verdict)
json.dump(out, open(sys.argv[2], "w"))
"""


def load_texts() -> list[str]:
    texts = []
    for path in CORPUS:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def family(reason: str | None) -> str | None:
    if reason is None:
        return None
    for prefix, fam in (("gopher_dup", "GopherRepetitionFilter"), ("gopher_top", "GopherRepetitionFilter"),
                        ("gopher_rep", "GopherRepetitionFilter"), ("gopher_", "GopherQualityFilter"),
                        ("c4_", "C4QualityFilter"), ("fineweb_", "FineWebQualityFilter")):
        if reason.startswith(prefix):
            return fam
    return reason


def main() -> None:
    py = DTVENV / "bin" / "python"
    if not py.exists():
        print(f"filter agreement: SKIPPED, no datatrove venv at {DTVENV} (create it with bench/make_dtvenv.sh)")
        return
    texts = load_texts()
    fineweb = load_config(FINEWEB_CONFIG).filter
    cfg = fineweb.model_copy(update={"rules": tuple(r for r in fineweb.rules if r != "language")})
    ours = [document_verdict(t, cfg)[0] for t in texts]
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "docs.jsonl", Path(d) / "verdicts.json"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        subprocess.run([str(py), "-c", DATATROVE_SCRIPT, str(src), str(dst)], check=True)
        theirs = json.loads(dst.read_text())
    keep_agree = sum((a is None) == (b is None) for a, b in zip(ours, theirs))
    fam_agree = sum(family(a and a[0]) == (b and b.split(":")[0]) for a, b in zip(ours, theirs))
    n = len(texts)
    print(f"filter agreement vs datatrove 0.10.1: {n} documents (corpus/python-docs), Gopher repetition + Gopher "
          "quality + C4 (no terminal-punct rule) + FineWeb")
    print(f"  kept by us {sum(a is None for a in ours)}, by datatrove {sum(b is None for b in theirs)}")
    print(f"  keep/drop agreement      : {keep_agree / n:.2%} ({keep_agree}/{n})")
    print(f"  same rule family agreement: {fam_agree / n:.2%}")
    diffs = Counter((a and a[0], b) for a, b in zip(ours, theirs) if (a is None) != (b is None))
    for (a, b), c in diffs.most_common(8):
        print(f"    disagree x{c}: ours={a} datatrove={b}")


if __name__ == "__main__":
    main()
