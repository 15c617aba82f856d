"""HTML and WARC readers for collect: main-text extraction with trafilatura, WARC records with warcio.

Both yield the same items as the readers in `tasks/data/collect/readers.py`: ("ok", record) or ("bad", source_id, reason,
detail). Memory is bounded by `max_doc_bytes`: an HTML file or a WARC payload larger than that is rejected as
`too_large` after reading at most `max_doc_bytes + 1` bytes of it (warcio skips the rest of the record).

Reason codes: `too_large`, `no_main_text` (trafilatura found no main content: a page of navigation only, an
empty page), `unsupported_content_type` (a WARC response whose payload is neither HTML nor plain text),
`invalid_utf8` (a `text/plain` payload that does not decode), `truncated_warc` (the archive breaks; the
records before the break are kept and the offset of the break is recorded).

Metadata kept in `meta`: the page title, author, date, hostname and, for WARC, the record date, the HTTP
content type and the record's byte offset. trafilatura's `filedate` (the extraction date) is left out on
purpose: it would make the output depend on the day it was produced.
"""

from __future__ import annotations

import json
from typing import Iterator

import trafilatura
from warcio.archiveiterator import ArchiveIterator
from warcio.exceptions import ArchiveLoadFailed

from lifecycle.core import fs
from lifecycle.tasks.data.collect.inputs import shown

META_KEYS = ("title", "author", "date", "hostname", "sitename")


def html_to_record(html: str | bytes, source_id: str, source: str, url: str | None, extra: dict) -> tuple:
    """Main text of one page with trafilatura (no comments, no tables of links); ("bad", ...) if none."""
    out = trafilatura.extract(html, url=url, output_format="json", with_metadata=True, include_comments=False,
                              deduplicate=False, favor_precision=False)
    data = json.loads(out) if out else None
    if not data or not (data.get("text") or "").strip():
        return ("bad", source_id, "no_main_text", "trafilatura found no main text")
    meta = {k: data[k] for k in META_KEYS if data.get(k)}
    meta.update(extra)
    page_url = url or data.get("source")  # the canonical link / og:url when the file itself has no URL
    return ("ok", {
        "source_id": source_id,
        "text": data["text"],
        "source": source,
        "url": page_url,
        "meta": json.dumps(meta, ensure_ascii=False, sort_keys=True) if meta else None,
    })


def read_html(path: str, max_doc_bytes: int) -> Iterator[tuple]:
    size, name = fs.size(path), shown(path)
    if size == 0:
        yield ("bad", f"{name}:0", "empty_file", "file is empty")
        return
    if size > max_doc_bytes:  # never read it: the rule is decided on the file size
        yield ("bad", name, "too_large", f"{size} bytes > max_doc_bytes={max_doc_bytes}")
        return
    yield html_to_record(fs.read_bytes(path), name, name, None, {})


def _read_capped(stream, cap: int) -> bytes | None:
    """Up to `cap` bytes of the stream; None if it holds more (the caller rejects it unread)."""
    data = stream.read(cap + 1)
    return None if len(data) > cap else data


def read_warc(path: str, max_doc_bytes: int) -> Iterator[tuple]:
    """Each `response` record is one document (other record types are not documents and are not rows)."""
    size, name = fs.size(path), shown(path)
    if size == 0:
        yield ("bad", f"{name}:0", "empty_file", "file is empty")
        return
    offset = end = 0
    with fs.open_bytes(path) as f:
        it = ArchiveIterator(f, arc2warc=True)
        try:
            for rec in it:
                if rec.rec_type != "response":
                    offset = it.get_record_offset()  # (reads the record to its end: call it after the payload)
                    end = offset + it.get_record_length()
                    continue
                h = rec.rec_headers
                sid = h.get_header("WARC-Record-ID") or f"{name}@{offset}"
                url = h.get_header("WARC-Target-URI")
                ctype = (rec.http_headers.get_header("Content-Type") if rec.http_headers else None) or ""
                payload = _read_capped(rec.content_stream(), max_doc_bytes)
                if payload is not None and getattr(rec.raw_stream, "limit", 0) > 0:
                    # the payload ended before its Content-Length: the file stops inside this record
                    yield ("bad", sid, "truncated_warc", f"archive ends inside the record after offset {offset}: "
                           f"{rec.raw_stream.limit} of {rec.length} bytes missing")
                    return
                offset = it.get_record_offset()
                end = offset + it.get_record_length()
                where = f"offset {offset}"
                if payload is None:
                    yield ("bad", sid, "too_large", f"{where}: payload > max_doc_bytes={max_doc_bytes}")
                    continue
                extra = {"warc_date": h.get_header("WARC-Date"), "content_type": ctype, "warc_offset": offset}
                mime = ctype.split(";")[0].strip().lower()
                if mime in ("text/html", "application/xhtml+xml", ""):
                    item = html_to_record(payload, sid, name, url, extra)
                    yield item if item[0] == "ok" else (*item[:3], f"{where}: {item[3]}")
                elif mime == "text/plain":
                    try:
                        text = payload.decode("utf-8")
                    except UnicodeDecodeError as e:
                        yield ("bad", sid, "invalid_utf8", f"{where}: byte {e.start}: {e.reason}")
                        continue
                    meta = json.dumps(extra, sort_keys=True)
                    yield ("ok", {"source_id": sid, "text": text, "source": name, "url": url, "meta": meta})
                else:
                    yield ("bad", sid, "unsupported_content_type", f"{where}: {mime}")
        except (ArchiveLoadFailed, EOFError, OSError, ValueError) as e:
            yield ("bad", f"{name}@{offset}", "truncated_warc", f"archive breaks after offset {offset}: {str(e)[:200]}")
            return
        # a .warc.gz cut between or inside gzip members ends the iteration silently: compare with the file size
        f.seek(end)
        if f.read(64).strip():
            yield ("bad", f"{name}@{end}", "truncated_warc",
                   f"archive breaks at offset {end}: {size - end} bytes after the last complete record are unreadable")
