"""Build the bundled corpus `corpus/python-docs/part-*.jsonl.gz` from Debian's `python3.11-doc` package.

Reproducible: the same .deb (or the same unpacked tree) gives byte-identical shards (sorted file order,
gzip with mtime=0 and no file name). Standard library only, so it runs without the project installed.

    python corpus/build_corpus.py --deb python3.11-doc_3.11.2-6+deb12u9_all.deb
    python corpus/build_corpus.py --root /path/where/the/deb/was/unpacked      # e.g. dpkg-deb -x pkg.deb root
    python corpus/build_corpus.py --deb pkg.deb --check                        # rebuild in memory, compare

(`apt-get download python3.11-doc` fetches the .deb.)

What it does:
- takes the reST sources Sphinx ships under usr/share/doc/python3.11/html/_sources/ (`*.rst.txt`) for the
  prose-heavy parts of the docs (SECTIONS below) - no library/ or c-api/ reference pages;
- splits each file into documents at its section and sub-section headings (levels 2 and 3, the page title
  being level 1; docutils ranks adornment styles by first appearance in the file); the text before the
  first such heading (page title and introduction) is one document too, and deeper levels stay inside
  their parent. A page without sections is one document. This gives ~2,000 documents from a few lines
  to ~60 kB, so the quality filter has realistic short ones to drop;
- renders the reST to the plain text a reader of the page sees, roughly what Sphinx's text builder emits:
  inline markup is unwrapped (:func:`repr` -> repr, ``x`` -> x, `text <url>`_ -> text, *em* -> em),
  heading underlines, comments, `.. index::`/`.. _label:` targets, toctrees and directive options are dropped,
  admonitions and version notes become their rendered words ("Note:", "New in version 3.2."), object
  directives become their signature line, and literal blocks (after `::`, code-block, doctest, ...) and
  `>>>` sessions are kept verbatim. Keeping raw reST instead would make the role/backtick punctuation
  dominate: the Gopher filter's alphabetic-word rule then drops ~70% of documents for markup alone;
- writes records {"id", "text", "source", "url", "title"} to SHARDS gzip'd JSONL shards of about equal size,
  and LICENSE-PSF.txt (the Python licence stack copied from the package's copyright file).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import sys
import tarfile
from pathlib import Path

SOURCES = "usr/share/doc/python3.11/html/_sources/"
COPYRIGHT = "usr/share/doc/python3.11-doc/copyright"
SECTIONS = ("tutorial/", "howto/", "faq/", "reference/", "using/", "extending/", "installing/",
            "distributing/", "whatsnew/", "glossary.rst.txt")
SOURCE_NAME = "python3.11-doc"
URL_BASE = "https://docs.python.org/3.11/"
SHARDS = 3
SPLIT_LEVELS = (2, 3)  # page title is level 1: split at sections and their sub-sections
OUT = Path(__file__).resolve().parent

_ADORNMENT = re.compile(r"([!-/:-@\[-`{-~])\1{2,}\s*$")  # a line of one repeated punctuation char
_LABEL = re.compile(r"\.\. _[^:]*:\s*$")  # `.. _tut-if:` (not `.. _name: url`, which carries a URL)
_INDEX = re.compile(r"(\s*)\.\. index::")
_ROLE = re.compile(r":[\w:.+-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
_DIRECTIVE = re.compile(r"(\s*)\.\. ([\w:-]+)::(?:\s+(.*))?$")
_COMMENT = re.compile(r"\s*\.\.(?:\s|$)")  # not a directive, footnote or target (those are matched first)
_FOOTNOTE = re.compile(r"(\s*)\.\. (\[[^\]]+\])\s*(.*)$")
_BULLET = re.compile(r"\s*(?:[*+-]|#\.|\d+\.|\(?[a-z\d]\))\s+\S")
_OPTION = re.compile(r"\s+:[\w-]+:")
_INLINE = re.compile(
    r"(?P<role>:(?:[\w-]+:)+`(?P<rt>(?:[^`\\]|\\.)+?)`)"
    r"|``(?P<lit>.+?)``"
    r"|`(?P<link>[^`]+?)`__?"
    r"|`(?P<dflt>[^`]+?)`"
    r"|\*\*(?P<strong>[^*\s](?:[^*]*?[^*\s])?)\*\*"
    r"|(?<![\w*\\])\*(?P<em>[^*\s](?:[^*]*?[^*\s\\])?)\*(?![\w*])"
    r"|(?P<fnref>\s?\[(?:#[\w-]*|\d+|\*)\]_)"
    r"|\\(?P<esc>[\s*`_|\\])",
    re.S,
)
_NUMBERED_ROLES = {"pep": "PEP {}", "rfc": "RFC {}", "issue": "bpo-{}", "gh": "gh-{}", "source": "{}"}
CODE_DIRECTIVES = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput", "productionlist",
                   "parsed-literal", "literalinclude"}
HIDDEN_DIRECTIVES = {"index", "toctree", "highlight", "currentmodule", "module", "tabularcolumns", "testsetup",
                     "testcleanup", "raw", "image", "figure", "include", "contents", "miscnews", "audit-event",
                     "program", "sectionauthor", "moduleauthor", "availability"}
# any other directive (`only`, object descriptions such as `method` or `envvar`): its arguments, then its body
ADMONITIONS = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
               "tip": "Tip:", "caution": "Caution:", "attention": "Attention:", "hint": "Hint:", "danger": "Danger:",
               "error": "Error:", "impl-detail": "CPython implementation detail:", "admonition": "",
               "topic": "", "sidebar": "", "rubric": "", "epigraph": "", "glossary": ""}
VERSIONS = {"versionadded": "New in version", "versionchanged": "Changed in version",
            "deprecated": "Deprecated since version", "deprecated-removed": "Deprecated since version"}


# --------------------------------------------------------------------------------------------------
# reading the package


def read_deb(deb: Path) -> tuple[dict[str, str], str, str]:
    """(relpath -> reST text, copyright text, package version) from a .deb, without unpacking to disk."""
    members = _ar_members(deb.read_bytes())
    version = _control_field(members, "Version")
    data = next(v for k, v in members.items() if k.startswith("data.tar"))
    files, copyright_text = {}, None
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for m in tar:
            name = m.name.removeprefix("./")
            if m.isfile() and (name.startswith(SOURCES) or name == COPYRIGHT):
                text = tar.extractfile(m).read().decode("utf-8")
                if name == COPYRIGHT:
                    copyright_text = text
                else:
                    files[name[len(SOURCES):]] = text
    if copyright_text is None or not files:
        raise SystemExit(f"{deb}: no {SOURCES} or {COPYRIGHT} inside; is this python3.11-doc?")
    return files, copyright_text, version


def read_root(root: Path) -> tuple[dict[str, str], str, str]:
    src, cp = root / SOURCES, root / COPYRIGHT
    if not src.is_dir() or not cp.is_file():
        raise SystemExit(f"{root}: expected {SOURCES} and {COPYRIGHT} below it (dpkg-deb -x pkg.deb {root})")
    files = {p.relative_to(src).as_posix(): p.read_text("utf-8") for p in src.rglob("*.rst.txt")}
    changelog = root / "usr/share/doc/python3.11-doc/changelog.Debian.gz"
    version = "unknown"
    if changelog.is_file():  # first line: "python3.11 (3.11.2-6+deb12u9) bookworm-security; urgency=medium"
        m = re.search(r"\(([^)]+)\)", gzip.decompress(changelog.read_bytes()).decode().splitlines()[0])
        version = m.group(1) if m else version
    return files, cp.read_text("utf-8"), version


def _ar_members(blob: bytes) -> dict[str, bytes]:
    if not blob.startswith(b"!<arch>\n"):
        raise SystemExit("not a Debian package (ar archive)")
    out, pos = {}, 8
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        out[name] = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return out


def _control_field(members: dict[str, bytes], field: str) -> str:
    ctl = next(v for k, v in members.items() if k.startswith("control.tar"))
    with tarfile.open(fileobj=io.BytesIO(ctl), mode="r:*") as tar:
        text = tar.extractfile("./control").read().decode()
    m = re.search(rf"^{field}:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else "unknown"


# --------------------------------------------------------------------------------------------------
# splitting reST into documents


def strip_metadata(lines: list[str]) -> list[str]:
    """Drop `.. _label:` targets and `.. index::` blocks (directive line plus its indented body)."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        m = _INDEX.match(line)
        if m:
            indent = len(m.group(1))
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                i += 1
            out.append("")
            continue
        if not _LABEL.match(line):
            out.append(line)
        i += 1
    # collapse the blank runs left behind
    squeezed: list[str] = []
    for line in out:
        if line.strip() or not squeezed or squeezed[-1].strip():
            squeezed.append(line)
    return squeezed


def find_headings(lines: list[str]) -> list[tuple[int, int, str, str]]:
    """Section titles as (first line index, level, style, title); level 1 is the page title."""
    styles: list[str] = []
    found = []
    i = 0
    while i < len(lines) - 1:
        prev_blank = i == 0 or not lines[i - 1].strip()
        over = _ADORNMENT.match(lines[i])
        if over and prev_blank and i + 2 < len(lines) and lines[i + 1].strip():
            under = _ADORNMENT.match(lines[i + 2])
            if under and under.group(1) == over.group(1):
                style, title, start, nxt = "over" + over.group(1), lines[i + 1].strip(), i, i + 3
            else:
                i += 1
                continue
        elif (
            prev_blank
            and lines[i].strip()
            and not lines[i][0].isspace()
            and not over
            and _ADORNMENT.match(lines[i + 1])
            and len(lines[i + 1].rstrip()) >= len(lines[i].rstrip())
        ):
            style, title, start, nxt = "under" + lines[i + 1][0], lines[i].strip(), i, i + 2
        else:
            i += 1
            continue
        if style not in styles:
            styles.append(style)
        found.append((start, styles.index(style) + 1, style, title))
        i = nxt
    return found


def plain_title(title: str) -> str:
    """`:keyword:`!if` Statements` -> `if Statements` (roles unwrapped, literal quotes dropped)."""
    return _ROLE.sub(r"\1", title).replace("``", "").replace("*", "").strip()


def slugify(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", plain_title(title).lower()).strip("-") or "section"


def _inline(m: re.Match, labels: dict[str, str]) -> str:
    if m.group("role") is not None:
        text, role = m.group("rt"), m.group("role").split("`")[0].strip(":")
        if role in _NUMBERED_ROLES:  # :pep:`8` renders as "PEP 8", :issue:`123` as "bpo-123"
            return _NUMBERED_ROLES[role].format(text.split("#")[0])
        if role == "ref" and text in labels:  # :ref:`tut-match` renders as that section's title
            return labels[text]
        target = re.fullmatch(r"(.*?)\s*<[^<>]*>", text, re.S)
        text = target.group(1) if target and target.group(1) else text
        text = text.lstrip("!")
        return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text
    if m.group("link") is not None:
        target = re.fullmatch(r"(.*?)\s*<[^<>]*>", m.group("link"), re.S)
        return target.group(1) if target and target.group(1) else m.group("link")
    if m.group("fnref") is not None:
        return ""
    if m.group("esc") is not None:
        return "" if m.group("esc").isspace() else m.group("esc")
    return next(v for k, v in m.groupdict().items() if v is not None and k in ("lit", "dflt", "strong", "em"))


def render_inline(text: str, labels: dict[str, str]) -> str:
    return _INLINE.sub(lambda m: _inline(m, labels), text)


def collect_labels(files: dict[str, str]) -> dict[str, str]:
    """`.. _label:` targets placed right before a section title -> that title (what :ref:`label` shows)."""
    labels = {}
    for text in files.values():
        lines = text.splitlines()
        titles = {start: plain_title(title) for start, _, _, title in find_headings(lines)}
        for i, line in enumerate(lines):
            m = re.match(r"\.\. _([^:]+):\s*$", line)
            if m:
                j = i + 1
                while j < len(lines) and (not lines[j].strip() or re.match(r"\.\. _[^:]+:\s*$", lines[j])):
                    j += 1
                if j in titles:
                    labels[m.group(1).lower()] = titles[j]
    return labels


def render(lines: list[str], labels: dict[str, str]) -> list[str]:
    """reST lines (heading adornments already removed) -> the text a reader of the rendered page sees."""
    out: list[tuple[bool, str]] = []  # (is_prose, line); prose runs get inline markup unwrapped together
    literal = skip = None  # indent of the construct whose deeper-indented body is kept verbatim / dropped
    pending = None  # indent of a paragraph that ended with "::": its indented continuation is literal
    options = False  # just after a directive line: its ":option: value" lines are dropped
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if options and stripped and _OPTION.match(line):
            continue
        options = False
        if skip is not None:
            if not stripped or indent > skip:
                continue
            skip = None
        if literal is not None:
            if not stripped or indent > literal:
                out.append((False, line))
                continue
            literal = None
        if pending is not None and stripped:
            literal, pending = (pending, None) if indent > pending else (None, None)
            if literal is not None:
                out.append((False, line))
                continue
        if not stripped:
            out.append((True, ""))
            continue
        doctest_more = stripped.startswith("...") and out and not out[-1][0] and out[-1][1].strip()
        if (stripped.startswith(">>>") or doctest_more) and stripped[3:4] in ("", " "):
            out.append((False, line))  # doctest blocks need no "::"
            continue
        d = _DIRECTIVE.match(line)
        if d:
            name, args, pad = d.group(2), (d.group(3) or "").strip(), d.group(1)
            options = True
            if name in CODE_DIRECTIVES:
                literal = indent
            elif name in HIDDEN_DIRECTIVES:
                skip = indent
            elif name in VERSIONS:
                version, _, rest = args.partition(" ")
                head = f"{pad}{VERSIONS[name]} {version.rstrip(',')}"
                end = "." if name == "versionadded" else ":"  # a changed/deprecated note has a body
                out.append((True, f"{head}: {rest}" if rest else head + end))
            elif name in ADMONITIONS:
                title = " ".join(x for x in (ADMONITIONS[name], args) if x)
                if title:
                    out.append((True, pad + title))
            elif args and name != "only":  # an object's signature (function, method, envvar, ...)
                out.append((True, pad + ("@" + args if name == "decorator" else args)))
            continue
        f = _FOOTNOTE.match(line)
        if f:
            out.append((True, f"{f.group(1)}{f.group(2)} {f.group(3)}".rstrip()))
            continue
        if _COMMENT.match(line) or line.lstrip().startswith(".. |"):
            skip = indent
            continue
        if stripped.endswith("::"):
            bullet = _BULLET.match(line)  # "* text::" - the paragraph's text starts after the marker
            pending = bullet.end() - 1 if bullet else indent
            body = line.rstrip()[:-2]
            if not body.strip():
                continue
            line = body.rstrip() if body.endswith((" ", "\t")) else body + ":"
        out.append((True, line))
    text_lines: list[str] = []
    k = 0
    while k < len(out):
        if not out[k][0]:
            text_lines.append(out[k][1])
            k += 1
            continue
        j = k
        while j < len(out) and out[j][0]:
            j += 1
        text_lines += render_inline("\n".join(line for _, line in out[k:j]), labels).split("\n")
        k = j
    squeezed: list[str] = []
    for line in text_lines:
        if line.strip() or not squeezed or squeezed[-1].strip():
            squeezed.append(line.rstrip())
    return squeezed


def split_file(relpath: str, text: str, labels: dict[str, str]) -> list[dict]:
    """One file -> documents at its SPLIT_LEVELS headings (plus the part before the first one)."""
    lines = strip_metadata(text.splitlines())
    heads = find_headings(lines)
    adornments = set()
    for start, _, style, _ in heads:  # keep the title line, drop its over/underline
        adornments.update((start, start + 2) if style.startswith("over") else (start + 1,))
    page_title = next((t for _, lvl, _, t in heads if lvl == 1), Path(relpath).name)
    cuts = [(start, title) for start, lvl, _, title in heads if lvl in SPLIT_LEVELS]
    spans = [(0, page_title)] + cuts
    docs, seen = [], {}
    name = relpath.removesuffix(".rst.txt")
    for k, (start, title) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else len(lines)
        body = "\n".join(render([lines[i] for i in range(start, end) if i not in adornments], labels)).strip("\n")
        if not body.strip():
            continue
        slug = slugify(title)
        seen[slug] = seen.get(slug, 0) + 1
        if seen[slug] > 1:  # sphinx numbers repeated titles the same way: foo, foo-1, ...
            slug = f"{slug}-{seen[slug] - 1}"
        docs.append({
            "id": f"{name}#{slug}",
            "text": body + "\n",
            "source": SOURCE_NAME,
            "url": f"{URL_BASE}{name}.html",
            "title": plain_title(title),
        })
    return docs


def selected(files: dict[str, str]) -> list[str]:
    return sorted(p for p in files if p.endswith(".rst.txt") and p.startswith(SECTIONS))


# --------------------------------------------------------------------------------------------------
# writing


def license_text(copyright_text: str) -> str:
    """The Python licence stack (history, PSF v2, BeOpen, CNRI, CWI) as the copyright file has it."""
    start = copyright_text.index("Python License\n==============")
    end = copyright_text.index("Licenses and Acknowledgements for Incorporated Software")
    return (
        "Licence of the Python 3.11 documentation bundled in corpus/python-docs/, copied verbatim from\n"
        f"/{COPYRIGHT} in Debian's python3.11-doc package. The documentation is licensed under the\n"
        "PSF License Agreement (below); since Python 3.8.6 code examples in it are also available under\n"
        "the Zero-Clause BSD licence (see the docs' license page, https://docs.python.org/3.11/license.html).\n\n"
        + copyright_text[start:end].rstrip()
        + "\n"
    )


def gz_jsonl(records: list[dict]) -> bytes:
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(raw)
    return buf.getvalue()


def build(files: dict[str, str], copyright_text: str) -> tuple[dict[str, bytes], dict]:
    labels = collect_labels(files)  # from all pages, library/ included, so cross-references resolve
    docs = [d for p in selected(files) for d in split_file(p, files[p], labels)]
    ids = [d["id"] for d in docs]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"duplicate ids: {sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    sizes = [len(d["text"].encode()) for d in docs]
    total = sum(sizes)
    shards: list[list[dict]] = [[] for _ in range(SHARDS)]
    acc = 0
    for d, n in zip(docs, sizes):  # contiguous, about equal bytes per shard
        shards[min(SHARDS - 1, acc * SHARDS // total)].append(d)
        acc += n
    out = {f"python-docs/part-{k:05d}.jsonl.gz": gz_jsonl(s) for k, s in enumerate(shards)}
    out["LICENSE-PSF.txt"] = license_text(copyright_text).encode()
    stats = {
        "files": len(selected(files)),
        "documents": len(docs),
        "text_bytes": total,
        "shards": {k: {"documents": len(s), "bytes": len(out[k]), "sha256": hashlib.sha256(out[k]).hexdigest()}
                   for k, s in zip(sorted(k for k in out if k.endswith(".gz")), shards)},
        "docs_by_section": _count_by_section(docs),
    }
    return out, stats


def _count_by_section(docs: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for d in docs:
        top = d["id"].split("/")[0] if "/" in d["id"] else d["id"].split("#")[0]
        counts[top] = counts.get(top, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--deb", type=Path, help="python3.11-doc_*.deb")
    src.add_argument("--root", type=Path, help="directory the .deb was unpacked into (holds usr/share/doc/...)")
    ap.add_argument("--out", type=Path, default=OUT, help="output directory (default: corpus/)")
    ap.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = ap.parse_args(argv)
    files, copyright_text, version = read_deb(args.deb) if args.deb else read_root(args.root)
    out, stats = build(files, copyright_text)
    stats = {"package": SOURCE_NAME, "version": version, **stats}
    if args.check:
        bad = [k for k, v in out.items() if not (args.out / k).is_file() or (args.out / k).read_bytes() != v]
        print(json.dumps(stats, indent=2))
        if bad:
            print(f"differ from {args.out}: {bad}", file=sys.stderr)
            return 1
        print(f"all {len(out)} files identical to {args.out}")
        return 0
    for rel, blob in out.items():
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
