"""What each filter preset keeps of each kind of text, and what each of its rules costs.

    python -m bench.presets CORPUS_DIR [--presets deploy/configs/fineweb.yaml,...] [--json]

CORPUS_DIR holds `*.jsonl.gz` files whose lines carry `text` and `kind` (what `python -m bench.real_corpus` writes:
man pages, generated reference pages, translated man pages, package docs, pydoc pages, Python source). For each
preset (a config file; its `filter` section is what counts) every document goes through the filter's rules in
the preset's order, as the filter stage runs them (`document_verdict`), and the table gives, per kind, the share
kept and the documents each rule dropped (a document counts against the first rule it fails, as in the funnel).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifecycle.config import load_config  # noqa: E402
from lifecycle.tasks.data.filter.stage import document_verdict, rule_of  # noqa: E402

PRESETS = ("deploy/configs/demo.yaml", "deploy/configs/fineweb.yaml", "deploy/configs/techdocs.yaml",
           "deploy/configs/code.yaml")


def corpus(path: Path):
    for f in sorted(path.glob("*.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                d = json.loads(line)
                yield d.get("kind", "unknown"), d["text"]


def measure(corpus_dir: Path, preset: str) -> dict:
    cfg = load_config(str(ROOT / preset) if not Path(preset).is_absolute() else preset, []).filter
    docs: collections.Counter = collections.Counter()
    kept: collections.Counter = collections.Counter()
    dropped: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, text in corpus(corpus_dir):
        docs[kind] += 1
        verdict = document_verdict(text, cfg)[0]
        if verdict is None:
            kept[kind] += 1
        else:
            dropped[kind][rule_of(verdict[0])] += 1
            reasons[kind][verdict[0]] += 1
    return {"preset": preset, "rules": list(cfg.rules),
            "kinds": {k: {"documents": docs[k], "kept": kept[k], "dropped_by_rule": dict(dropped[k]),
                          "dropped_by_reason": dict(reasons[k])}
                      for k in sorted(docs)}}


def table(results: list[dict]) -> str:
    kinds = sorted({k for r in results for k in r["kinds"]})
    head = "| preset | " + " | ".join(kinds) + " |\n|---|" + "---|" * len(kinds) + "\n"
    rows = []
    for r in results:
        cells = []
        for k in kinds:
            s = r["kinds"].get(k)
            if not s:
                cells.append("")
                continue
            top = sorted(s["dropped_by_rule"].items(), key=lambda kv: -kv[1])[:2]
            cost = ", ".join(f"{rule} -{n}" for rule, n in top)
            cells.append(f"{s['kept'] / s['documents']:.0%} kept of {s['documents']}" + (f" ({cost})" if cost else ""))
        rows.append(f"| {Path(r['preset']).stem} | " + " | ".join(cells) + " |")
    return head + "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.presets", description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path, help="directory of *.jsonl.gz with `text` and `kind` per line")
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated config files")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the Markdown table")
    a = ap.parse_args(argv)
    results = []
    for p in a.presets.split(","):
        results.append(measure(a.corpus, p))
    print(json.dumps(results) if a.json else table(results))


if __name__ == "__main__":
    main()
