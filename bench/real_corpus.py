"""A corpus of real documents, built from what this machine's Debian and Python packages hold: man pages (English,
generated reference pages, and the translated ones), package documentation, pydoc pages of installed modules, and Python source files.

    python -m bench.real_corpus OUT_DIR [--mb 24] [--files 8] [--seed 0] [--kinds man,man_generated,man_l10n,doc,pydoc,code]

Nothing is downloaded. The kinds are mixed the way a crawl mixes pages: most of it is not the prose that web-text
filters keep (reference pages, changelogs, licences, other languages, code), so a FineWeb-style filter drops most
of it. Each line of the `OUT_DIR/part-NNN.jsonl.gz` files is `{"id", "text", "kind"}` (`id` is `<kind>:<path>`,
`kind` lands in the collect dataset's `meta`). `OUT_DIR/corpus.json` records how many documents and bytes of each
kind were written and the sha256 of every file.

The same seed gives the same files on the same set of installed packages: candidates are listed in sorted order,
shuffled with the seed, and rendered in that order until `--mb` megabytes of text are written. Man pages are
rendered by groff (`-mandoc -Tutf8`, no hyphenation, no overstrike), as `man` renders them for a terminal 80
columns wide.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import pydoc
import random
import subprocess
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MAN = Path("/usr/share/man")
DOC = Path("/usr/share/doc")
KINDS = ("man", "man_generated", "man_l10n", "doc", "pydoc", "code")
WEIGHTS = {"man": 4, "man_generated": 1, "man_l10n": 1, "doc": 2, "pydoc": 1, "code": 2}  # drawn per round, by kind
GENERATED_MAN = "gcloud"  # Google Cloud SDK's 16,000 generated reference pages: their own kind, so as not to flood
DOC_SUFFIXES = (".txt", ".md", ".rst", ".gz", "")  # README, NEWS, copyright, changelog.Debian.gz, ...
MAX_DOC_BYTES = 1 << 20  # a longer file is cut here (a few changelogs and generated sources run to megabytes)


def candidates(kind: str) -> list[str]:
    """What `kind` can draw from, sorted: paths, or module names for pydoc."""
    if kind in ("man", "man_generated"):
        return sorted(str(p) for p in MAN.glob("man[1-8]/*")
                      if p.is_file() and p.name.startswith(GENERATED_MAN) == (kind == "man_generated"))
    if kind == "man_l10n":
        return sorted(str(p) for p in MAN.glob("[a-z][a-z]*/man[1-8]/*") if p.is_file())
    if kind == "doc":
        return sorted(str(p) for p in DOC.rglob("*") if p.is_file() and not p.is_symlink()
                      and (p.suffix in DOC_SUFFIXES or p.name.startswith(("README", "NEWS", "copyright"))))
    if kind == "pydoc":
        return sorted(name for name in sys.stdlib_module_names if not name.startswith("_"))
    if kind == "code":
        roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
        return sorted(str(p) for r in roots for p in Path(r).rglob("*.py") if p.is_file())
    raise ValueError(f"unknown kind {kind!r}: choose from {', '.join(KINDS)}")


def render(item: tuple[str, str]) -> tuple[str, str, str] | None:
    """(kind, id, text) of one candidate, or None when it gives no text (binary, empty, a failed render)."""
    kind, what = item
    try:
        if kind.startswith("man"):
            raw = gzip.decompress(Path(what).read_bytes()) if what.endswith(".gz") else Path(what).read_bytes()
            if raw.startswith(b".so "):  # a link to another page, which is drawn on its own
                return None
            out = subprocess.run(["groff", "-t", "-k", "-mandoc", "-Tutf8", "-rHY=0", "-dAD=l", "-P-cbou", "-rLL=80n"],
                                 input=raw, capture_output=True, timeout=60, env={**os.environ, "LC_ALL": "C.UTF-8"})
            text = out.stdout.decode("utf-8", "replace")
        elif kind == "doc":
            raw = Path(what).read_bytes()[: 8 * MAX_DOC_BYTES]
            if what.endswith(".gz"):
                raw = gzip.decompress(raw)
            if b"\x00" in raw[:4096]:
                return None
            text = raw.decode("utf-8")
        elif kind == "pydoc":
            import importlib
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text = pydoc.render_doc(importlib.import_module(what), renderer=pydoc.plaintext)
        else:
            text = Path(what).read_text("utf-8")
    except (OSError, UnicodeDecodeError, ImportError, subprocess.TimeoutExpired, EOFError, gzip.BadGzipFile,
            SyntaxError, ValueError, RuntimeError):
        return None
    text = text.encode("utf-8")[:MAX_DOC_BYTES].decode("utf-8", "ignore").strip()
    return (kind, f"{kind}:{what}", text) if text else None


def draw_order(kinds: list[str], seed: int) -> list[tuple[str, str]]:
    """Every candidate of every kind once, kinds interleaved by WEIGHTS, each kind in its own seeded order."""
    rng = random.Random(seed)
    pools = {}
    for k in kinds:
        pool = candidates(k)
        rng.shuffle(pool)
        pools[k] = pool
    order, pos = [], {k: 0 for k in kinds}
    while any(pos[k] < len(pools[k]) for k in kinds):
        for k in kinds:
            take = pools[k][pos[k]:pos[k] + WEIGHTS[k]]
            pos[k] += len(take)
            order.extend((k, w) for w in take)
    return order


def build(out: Path, mb: float, files: int = 8, seed: int = 0, kinds: list[str] | None = None,
          workers: int = 2) -> dict:
    kinds = list(kinds or KINDS)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("part-*.jsonl.gz")):
        raise SystemExit(f"{out} already holds part-*.jsonl.gz files; give an empty or new directory")
    target = int(mb * 1e6)
    paths = [out / f"part-{i:03d}.jsonl.gz" for i in range(files)]
    sinks = [gzip.open(p, "wt", encoding="utf-8", compresslevel=6) for p in paths]
    per_kind = {k: {"documents": 0, "bytes": 0} for k in kinds}
    written = n = 0
    order = draw_order(kinds, seed)
    with ProcessPoolExecutor(workers) as pool:
        for got in pool.map(render, order, chunksize=16):
            if got is None:
                continue
            kind, doc_id, text = got
            size = len(text.encode("utf-8"))
            sinks[n % files].write(json.dumps({"id": doc_id, "text": text, "kind": kind}, ensure_ascii=False) + "\n")
            per_kind[kind]["documents"] += 1
            per_kind[kind]["bytes"] += size
            written += size
            n += 1
            if written >= target:
                pool.shutdown(wait=False, cancel_futures=True)
                break
    for s in sinks:
        s.close()
    summary = {"documents": n, "text_bytes": written, "target_bytes": target, "seed": seed, "kinds": per_kind,
               "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}}
    if written < target:
        summary["note"] = f"this machine's packages hold only {written / 1e6:.1f} MB of these kinds"
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.real_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for part-NNN.jsonl.gz and corpus.json (new or empty)")
    ap.add_argument("--mb", type=float, default=24.0, help="megabytes of document text to write (default 24)")
    ap.add_argument("--files", type=int, default=8, help="number of part files (default 8)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the draw order (default 0)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--workers", type=int, default=2, help="rendering processes (default 2)")
    a = ap.parse_args(argv)
    summary = build(a.out, a.mb, a.files, a.seed, [k for k in a.kinds.split(",") if k], a.workers)
    print(json.dumps({k: summary[k] for k in ("documents", "text_bytes", "kinds")}))


if __name__ == "__main__":
    main()
