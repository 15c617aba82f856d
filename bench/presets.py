"""What each filter preset keeps of each kind of text, and what each of its rules costs.

    python -m bench.presets DIR [--presets deploy/configs/fineweb.yaml,...] [--kind auto|folder|extension] [--json]

DIR is any folder of files collect reads (.jsonl[.gz|.zst], .parquet, .txt/.rst/.md/.markdown[.gz|.zst], .html,
.warc[.gz]), searched recursively and read by collect's own readers. A document's kind is its record's `kind`
field (what `python -m bench.real_corpus` writes: man pages, generated reference pages, translated man pages,
package docs, pydoc pages, Python source); without one (or with `--kind folder|extension`), the top folder under
DIR that holds its file, or else its file's extension (`rst` for a.rst.gz). Records collect would reject
(bad UTF-8, an HTML page without main text...) are counted per kind as `unreadable`. For each preset (a config
file; its `filter` section is what counts) every document goes through the filter's rules in the preset's order,
as the filter stage runs them (`document_verdict`), and the table gives, per kind, the share kept and the documents
each rule dropped (a document counts against the first rule it fails, as in the funnel).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifecycle.config import ConfigError, load_config  # noqa: E402
from lifecycle.tasks.data.collect.stage import READERS, CollectConfig, InputError, file_kind  # noqa: E402
from lifecycle.tasks.data.collect.streams import COMPRESSED  # noqa: E402
from lifecycle.tasks.data.filter.stage import document_verdict, rule_of  # noqa: E402

PRESETS = ("deploy/configs/demo.yaml", "deploy/configs/fineweb.yaml", "deploy/configs/techdocs.yaml",
           "deploy/configs/code.yaml")
UNREADABLE = "unreadable"


class CorpusError(ValueError):
    """DIR is not a folder, or holds no file collect reads."""


def input_files(root: Path) -> list[Path]:
    """The files under `root` (recursively, sorted, hidden ones left out) whose type collect reads."""
    if not root.is_dir():
        raise CorpusError(f"{root}: not a folder")
    found = []
    for f in sorted(root.rglob("*")):
        if f.is_file() and not any(p.startswith(".") for p in f.relative_to(root).parts):
            try:
                file_kind(str(f))
            except InputError:
                continue
            found.append(f)
    if not found:
        raise CorpusError(f"{root}: no file collect reads (.jsonl[.gz|.zst], .parquet, .txt/.rst/.md[.gz|.zst], "
                          ".html, .warc[.gz])")
    return found


def file_label(root: Path, f: Path, by: str) -> str:
    """The kind of a document without a `kind` field: its top folder under `root`, or its extension."""
    parts = f.relative_to(root).parts
    if by != "extension" and len(parts) > 1:
        return parts[0]
    name = f.name.lower()
    for z in COMPRESSED:
        name = name.removesuffix(z)
    return name.rsplit(".", 1)[-1]


def corpus(root: Path, by: str = "auto"):
    """(kind, text or None when collect would reject the record) of every document under `root`."""
    cfg = CollectConfig(inputs=[str(root)])
    for f in input_files(root):
        label = file_label(root, f, by)
        for item in READERS[file_kind(str(f))](str(f), cfg):
            if item[0] != "ok":
                yield label, None
                continue
            meta = json.loads(item[1]["meta"] or "{}")
            kind = meta.get("kind") if by == "auto" and isinstance(meta, dict) else None
            yield str(kind) if kind is not None else label, item[1]["text"]


def measure(documents: list[tuple[str, str | None]], preset: str) -> dict:
    """Per kind: documents, kept, and the documents each rule (and reason) dropped, under `preset`'s filter."""
    cfg = load_config(str(ROOT / preset) if not Path(preset).is_absolute() else preset, []).filter
    docs: collections.Counter = collections.Counter()
    kept: collections.Counter = collections.Counter()
    dropped: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, text in documents:
        docs[kind] += 1
        if text is None:
            dropped[kind][UNREADABLE] += 1
            reasons[kind][UNREADABLE] += 1
            continue
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
    ap.add_argument("corpus", type=Path, help="a folder of files collect reads (searched recursively)")
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated config files")
    ap.add_argument("--kind", choices=("auto", "folder", "extension"), default="auto", help=(
        "a document's kind: its `kind` field, else its top folder, else its extension (auto); or always the folder "
        "(else the extension), or always the extension"))
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the Markdown table")
    a = ap.parse_args(argv)
    try:
        documents = list(corpus(a.corpus, a.kind))  # read once (HTML extraction is slow), judged per preset
        results = [measure(documents, p) for p in a.presets.split(",")]
    except (CorpusError, ConfigError) as e:
        print(f"python -m bench.presets: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(results) if a.json else table(results))


if __name__ == "__main__":
    main()
