"""A corpus of real documents, built from what this machine's Debian and Python packages hold: man pages (English,
generated reference pages, and the translated ones), package documentation (plain text, and HTML manuals turned into
text by trafilatura as a crawl's pages are), pydoc pages of installed modules, Python source files, and source trees
(Go's standard library, and the kernel's from Debian's linux-source tarball).

    python -m bench.real_corpus OUT_DIR [--mb 24] [--files 8] [--seed 0] [--mix crawl|uniform] [--src DIR]

Nothing is downloaded. Each line of the `OUT_DIR/part-NNN.jsonl.gz` files is `{"id", "text", "kind"}` (`id` is
`<kind>:<path>`, `kind` lands in the collect dataset's `meta`). `OUT_DIR/corpus.json` records the mix, how many
documents and bytes of each kind were written and the sha256 of every file. Two mixes:

- `crawl` (default; the corpus of the datatrove comparison): man pages, generated and translated man pages, plain
  text package docs, pydoc pages and Python source, drawn round-robin by CRAWL_WEIGHTS, each kind in its own seeded
  order. Most of it is not the prose that web-text filters keep (reference pages, changelogs, licences, other
  languages, code), so a FineWeb-style filter drops most of it, as on a crawl. A kind that runs out leaves the
  others, so the mix changes with size, and these kinds hold only ~860 MB.
- `uniform` (the corpus of the scaling run): every kind, HTML manuals and the source trees too (~2.3 GB on this
  machine), in one seeded shuffle, rendered in that order until `--mb` megabytes of text are written. Every size is
  a uniform sample of what the machine holds and a prefix of a larger one (same seed), so docs/s at 24 MB and at
  2.3 GB is measured on the same mix. Three quarters of its bytes are source code (the kernel's, Python's):
  only source trees hold that much text here.

The same seed gives the same files (byte for byte: no gzip time stamp, no memory address in pydoc pages) on the
same set of installed packages, but for pydoc's page of `sys`, which shows the command line. Man pages are rendered by groff
(`-mandoc -Tutf8`, no hyphenation, no overstrike), as `man` renders them for a terminal 80 columns wide. HTML pages
are extracted with trafilatura (`favor_recall`, tables kept). The kernel's tarball (`/usr/src/linux-source-*.tar.*`,
Debian package linux-source-6.1) is unpacked once under `--src` (default `OUT_DIR/../src`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import hashlib
import io
import json
import os
import pydoc
import random
import re
import subprocess
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MAN = Path("/usr/share/man")
DOC = Path("/usr/share/doc")
KINDS = ("man", "man_generated", "man_l10n", "doc", "html", "pydoc", "code", "source")
MIXES = {  # name: the kinds it draws (how: draw_order)
    "crawl": ("man", "man_generated", "man_l10n", "doc", "pydoc", "code"),
    "uniform": KINDS,
}
CRAWL_WEIGHTS = {"man": 4, "man_generated": 1, "man_l10n": 1, "doc": 2, "pydoc": 1, "code": 2}  # per round
GENERATED_MAN = "gcloud"  # Google Cloud SDK's 16,000 generated reference pages: their own kind, so as not to flood
DOC_SUFFIXES = (".txt", ".md", ".rst", ".gz", "")  # README, NEWS, copyright, changelog.Debian.gz, ...
MAX_DOC_BYTES = 1 << 20  # a longer file is cut here (a few changelogs and generated sources run to megabytes)
MAX_HTML_BYTES = 4 << 20  # a larger page (a generated index) is skipped: trafilatura would take minutes on it
HTML_SUFFIXES = (".html", ".htm")
ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a memory address in a pydoc page: differs in every process
SOURCE_ROOTS = ("/usr/share/go-*/src",)  # plus the kernel tree unpacked under --src


def candidates(kind: str, src_root: Path | None = None) -> list[str]:
    """What `kind` can draw from, sorted: paths, or module names for pydoc; `src_root`: where the kernel tree is."""
    if kind in ("man", "man_generated"):
        return sorted(str(p) for p in MAN.glob("man[1-8]/*")
                      if p.is_file() and p.name.startswith(GENERATED_MAN) == (kind == "man_generated"))
    if kind == "man_l10n":
        return sorted(str(p) for p in MAN.glob("[a-z][a-z]*/man[1-8]/*") if p.is_file())
    if kind == "doc":
        return sorted(str(p) for p in DOC.rglob("*") if p.is_file() and not p.is_symlink()
                      and (p.suffix in DOC_SUFFIXES or p.name.startswith(("README", "NEWS", "copyright"))))
    if kind == "html":
        seen, out = set(), []
        for p in sorted(DOC.rglob("*")):  # a package's doc directory may be a symlink to another's: each page once
            if p.suffix in HTML_SUFFIXES and p.is_file() and (real := p.resolve()) not in seen:
                seen.add(real)
                out.append(str(real))
        return out
    if kind == "source":
        roots = [Path(r) for pattern in SOURCE_ROOTS for r in sorted(glob.glob(pattern))]
        roots += sorted(p for p in (src_root or Path("/nonexistent")).glob("linux-source-*") if p.is_dir())
        return sorted(str(p) for r in roots for p in r.rglob("*") if p.is_file() and not p.is_symlink())
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
        elif kind == "html":
            path = Path(what)
            if path.stat().st_size > MAX_HTML_BYTES:
                return None
            import trafilatura

            text = trafilatura.extract(path.read_bytes().decode("utf-8", "replace"), favor_recall=True,
                                       include_tables=True) or ""
        elif kind == "pydoc":
            import importlib
            import warnings

            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # `this` prints on import
                warnings.simplefilter("ignore")
                text = pydoc.render_doc(importlib.import_module(what), renderer=pydoc.plaintext)
            text = ADDRESS.sub(" at 0x0", text)  # default values' reprs: `<object object at 0x7f...>`
        else:  # code, source
            raw = Path(what).read_bytes()
            if b"\x00" in raw[:4096]:
                return None
            text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, ImportError, subprocess.TimeoutExpired, EOFError, gzip.BadGzipFile,
            SyntaxError, ValueError, RuntimeError):
        return None
    text = text.encode("utf-8")[:MAX_DOC_BYTES].decode("utf-8", "ignore").strip()
    return (kind, f"{kind}:{what}", text) if text else None


def unpack_kernel(src_root: Path) -> None:
    """Unpack Debian's kernel source tarball(s) under `src_root` once (a `.unpacked` marker per tarball)."""
    for tarball in sorted(Path("/usr/src").glob("linux-source-*.tar.*")):
        marker = src_root / f".unpacked-{tarball.name}"
        if marker.exists():
            continue
        src_root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xaf", str(tarball), "-C", str(src_root)], check=True)
        marker.write_text("")


def draw_order(mix: str, seed: int, src_root: Path | None = None) -> list[tuple[str, str]]:
    """Every candidate of every kind of MIXES[mix] once. `crawl`: each kind in its own seeded order, kinds interleaved by
    CRAWL_WEIGHTS (a kind that runs out leaves the others). `uniform`: one seeded shuffle of all of them, so every
    prefix is a uniform sample of the same mix."""
    kinds = MIXES[mix]
    if mix == "uniform":
        order = [(k, what) for k in kinds for what in candidates(k, src_root)]
        random.Random(seed).shuffle(order)
        return order
    rng = random.Random(seed)
    pools = {}
    for k in kinds:
        pool = candidates(k, src_root)
        rng.shuffle(pool)
        pools[k] = pool
    order, pos = [], {k: 0 for k in kinds}
    while any(pos[k] < len(pools[k]) for k in kinds):
        for k in kinds:
            take = pools[k][pos[k]:pos[k] + CRAWL_WEIGHTS[k]]
            pos[k] += len(take)
            order.extend((k, w) for w in take)
    return order


def build(out: Path, mb: float, files: int = 8, seed: int = 0, mix: str = "crawl", workers: int = 2,
          src_root: Path | None = None) -> dict:
    kinds = list(MIXES[mix])
    src_root = src_root or out.resolve().parent / "src"
    if "source" in kinds:
        unpack_kernel(src_root)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("part-*.jsonl.gz")):
        raise SystemExit(f"{out} already holds part-*.jsonl.gz files; give an empty or new directory")
    target = int(mb * 1e6)
    paths = [out / f"part-{i:03d}.jsonl.gz" for i in range(files)]
    sinks = [io.TextIOWrapper(gzip.GzipFile(p, "wb", compresslevel=6, mtime=0), encoding="utf-8")  # no time stamp
             for p in paths]
    per_kind = {k: {"documents": 0, "bytes": 0} for k in kinds}
    written = n = 0
    order = draw_order(mix, seed, src_root)
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
    summary = {"documents": n, "text_bytes": written, "target_bytes": target, "seed": seed, "mix": mix,
               "kinds": per_kind,
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
    ap.add_argument("--mix", choices=sorted(MIXES), default="crawl",
                    help="crawl (default): man pages, docs, pydoc and Python source, round-robin by weight; uniform: "
                         "every kind (HTML manuals and source trees too) in one shuffle, the same mix at every size")
    ap.add_argument("--workers", type=int, default=2, help="rendering processes (default 2)")
    ap.add_argument("--src", type=Path, default=None, help="where the kernel tarball is unpacked (default OUT_DIR/../src)")
    a = ap.parse_args(argv)
    summary = build(a.out, a.mb, a.files, a.seed, a.mix, a.workers, a.src)
    print(json.dumps({k: summary[k] for k in ("documents", "text_bytes", "kinds")}))


if __name__ == "__main__":
    main()
