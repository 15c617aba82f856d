"""collect: every input format, every bad-record reason, and the accounting identity."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lifecycle.tasks.data.collect.stage import CollectConfig, InputError, make_doc_id, resolve_inputs, run_collect


def write_jsonl(path, lines: list[bytes]):
    path.write_bytes(b"".join(l + b"\n" for l in lines))
    return path


def collect(tmp_path, patterns, **kw):
    return run_collect(CollectConfig(inputs=[str(tmp_path / p) for p in patterns], **kw), str(tmp_path / "w"))


def test_jsonl_good_and_bad_records_all_accounted(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [
        json.dumps({"id": "doc-1", "text": "hello world", "url": "https://x.org", "lang": "en"}).encode(),
        b"this is not json",
        json.dumps({"id": "doc-3"}).encode(),
        json.dumps({"text": 42}).encode(),
        b'{"text": "broken \xff utf8"}',
        b"",  # blank lines are not records
        json.dumps({"text": "   "}).encode(),
        json.dumps(["a", "list"]).encode(),
        json.dumps({"text": "nul\u0000inside"}).encode(),
        json.dumps({"text": "last good one"}).encode(),
    ])
    ref = collect(tmp_path, ["a.jsonl"])
    kept = ref.read().to_pylist()
    assert [r["text"] for r in kept] == ["hello world", "last good one"]
    assert kept[0]["source_id"] == "doc-1" and kept[0]["url"] == "https://x.org"
    assert json.loads(kept[0]["meta"]) == {"lang": "en"}
    assert kept[1]["source_id"].endswith("a.jsonl:10")
    assert kept[0]["doc_id"] == make_doc_id("doc-1", "hello world")
    rej = {r["source_id"].rsplit("/", 1)[-1]: r["reason"] for r in ref.read_rejected().to_pylist()}
    assert rej == {"a.jsonl:2": "invalid_json", "doc-3": "missing_text", "a.jsonl:4": "text_not_string",
                   "a.jsonl:5": "invalid_utf8", "a.jsonl:7": "empty_text", "a.jsonl:8": "not_an_object",
                   "a.jsonl:9": "nul_bytes"}
    stats = ref.manifest()["stats"]
    assert stats["rows_in"] == 9 == stats["rows_kept"] + stats["rows_rejected"]
    assert all(r["detail"].startswith(str(tmp_path / "a.jsonl")) for r in ref.read_rejected().to_pylist())


def test_gzip_parquet_txt_and_truncated_gzip(tmp_path):
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        for i in range(200):
            f.write((json.dumps({"id": f"g{i}", "text": f"gzip record number {i} " * 20}) + "\n").encode())
    data = (tmp_path / "b.jsonl.gz").read_bytes()
    (tmp_path / "c.jsonl.gz").write_bytes(data[: len(data) // 2])  # truncated copy
    pq.write_table(pa.table({"text": ["parquet doc", None], "id": ["p1", "p2"], "extra": [1, 2]}), tmp_path / "d.parquet")
    (tmp_path / "e.txt").write_text("a whole text file is one document\nwith two lines")
    (tmp_path / "f.parquet").write_bytes(b"PAR1 this is not parquet")
    ref = collect(tmp_path, ["*.gz", "*.parquet", "*.txt"])
    rows = ref.read().to_pylist()
    ids = [r["source_id"] for r in rows]
    assert ids[:200] == [f"g{i}" for i in range(200)]
    truncated = [i for i in ids[200:] if i.startswith("g")]
    assert 0 < len(truncated) < 200  # what decompressed before the break is kept
    assert "p1" in ids and json.loads(rows[ids.index("p1")]["meta"]) == {"extra": 1}
    assert rows[-1]["text"].startswith("a whole text file") and rows[-1]["source_id"].endswith("e.txt")
    reasons = sorted(r["reason"] for r in ref.read_rejected().to_pylist())
    assert reasons == ["missing_text", "truncated_gzip", "unreadable_parquet"]
    s = ref.manifest()["stats"]
    assert s["rows_in"] == s["rows_kept"] + s["rows_rejected"]


def test_kept_parts_are_cut_by_bytes_of_text_with_the_same_rows(tmp_path):
    """A compressed file is one shard (never split), but its kept rows land in parts of about `max_part_bytes`,
    so the later stages, which hold one part at a time, need the same memory on any input size."""
    with gzip.open(tmp_path / "big.jsonl.gz", "wb") as f:
        for i in range(300):
            f.write((json.dumps({"id": f"d{i}", "text": f"record {i} " + "word " * 400}) + "\n").encode())
    whole = run_collect(CollectConfig(inputs=[str(tmp_path / "big.jsonl.gz")]), str(tmp_path / "w1"))
    cut = run_collect(CollectConfig(inputs=[str(tmp_path / "big.jsonl.gz")], max_part_bytes=100_000),
                      str(tmp_path / "w2"))
    assert len(whole.manifest()["files"]) == 1
    parts = [pq.read_table(f) for f in cut.files()]
    assert len(parts) >= 6  # 300 rows of 2 kB of text: 600 kB, and more as Python strings with their rows
    assert all(sum(len(t) for t in part.column("text").to_pylist()) < 100_000 + 2_100 for part in parts)
    assert cut.read().to_pylist() == whole.read().to_pylist()  # same rows, same order


def test_too_large_rule(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": "x" * 100}).encode(), json.dumps({"text": "ok"}).encode()])
    ref = collect(tmp_path, ["a.jsonl"], max_doc_bytes=50)
    assert [r["text"] for r in ref.read().to_pylist()] == ["ok"]
    assert [r["reason"] for r in ref.read_rejected().to_pylist()] == ["too_large"]


def test_manifest_contract_and_rerun_reuses(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": f"doc {i}"}).encode() for i in range(5)])
    ref = collect(tmp_path, ["a.jsonl"], rows_per_shard=2)
    m = ref.manifest()
    for key in ("stage", "fingerprint", "sha256", "num_rows", "files", "rejected", "parents", "config", "inputs"):
        assert key in m
    assert m["num_rows"] == 5 and len(m["files"]) == 3 and m["inputs"][0]["sha256"]
    assert not ref.reused
    again = collect(tmp_path, ["a.jsonl"], rows_per_shard=2)
    assert again.reused and again.sha256 == ref.sha256
    # changing an input file changes the fingerprint: a new dataset
    write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": "changed"}).encode()])
    changed = collect(tmp_path, ["a.jsonl"], rows_per_shard=2)
    assert not changed.reused and changed.fingerprint != ref.fingerprint


def test_bad_patterns_fail_before_work(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        resolve_inputs([str(tmp_path / "nothing-*.jsonl")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="unsupported input type"):
        resolve_inputs([str(tmp_path / "x.csv")])


# --------------------------------------------------------------------------------------------------
# .zst, HTML, WARC, and the rest of the bad-input cases

ARTICLE = ("<html><head><title>Gardens</title><link rel='canonical' href='https://example.org/gardens'></head><body>"
           "<nav><a href='/'>Home</a> | <a href='/about'>About us</a> | <a href='/shop'>Shop</a></nav>"
           "<article><h1>Winter gardens</h1><p>" + "A winter garden needs plants that keep their leaves and colour "
           "when the days are short and the nights are cold. " * 6 + "</p><p>Hellebores flower in January.</p>"
           "</article><footer>Cookie settings and legal notice</footer></body></html>")


def test_zstd_jsonl_and_truncated_zstd(tmp_path):
    import zstandard

    import hashlib

    # incompressible text, so the stream spans many zstd blocks and a cut lands after some of them
    body = b"".join((json.dumps({"id": f"z{i}", "text": hashlib.sha256(str(i).encode()).hexdigest() * 30})
                     + "\n").encode() for i in range(300))
    data = zstandard.ZstdCompressor().compress(body)
    (tmp_path / "a.jsonl.zst").write_bytes(data)
    (tmp_path / "b.jsonl.zst").write_bytes(data[: len(data) // 2])
    ref = collect(tmp_path, ["*.zst"])
    ids = [r["source_id"] for r in ref.read().to_pylist()]
    assert ids[:300] == [f"z{i}" for i in range(300)]
    assert 0 < len(ids) - 300 < 300  # what decompressed before the break is kept
    rej = ref.read_rejected().to_pylist()
    assert [r["reason"] for r in rej] == ["truncated_zstd"]
    assert rej[0]["source_id"].startswith(str(tmp_path / "b.jsonl.zst") + ":")
    s = ref.manifest()["stats"]
    assert s["rows_in"] == s["rows_kept"] + s["rows_rejected"] == len(ids) + 1


def test_html_main_text_url_and_metadata(tmp_path):
    (tmp_path / "page.html").write_text(ARTICLE)
    (tmp_path / "menu.html").write_text("<html><head><script>var x = 1;</script></head><body></body></html>")
    ref = collect(tmp_path, ["*.html"])
    [row] = ref.read().to_pylist()
    assert "Hellebores flower in January." in row["text"] and "winter garden needs plants" in row["text"]
    assert "Cookie settings" not in row["text"] and "About us" not in row["text"]  # boilerplate is gone
    assert row["url"] == "https://example.org/gardens"
    assert json.loads(row["meta"])["title"] == "Winter gardens"  # trafilatura prefers the page's h1
    assert "filedate" not in json.loads(row["meta"])  # extraction date would break reproducibility
    assert [(r["source_id"].rsplit("/", 1)[-1], r["reason"]) for r in ref.read_rejected().to_pylist()] == [
        ("menu.html", "no_main_text")]


def write_warc(path, records, gz=True):
    from io import BytesIO

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as f:
        w = WARCWriter(f, gzip=gz)
        for kind, url, ctype, body in records:
            if kind == "request":
                rec = w.create_warc_record(url, "request", payload=BytesIO(b"GET / HTTP/1.1\r\n\r\n"))
            else:
                http = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.1")
                rec = w.create_warc_record(url, "response", payload=BytesIO(body), http_headers=http)
            w.write_record(rec)


def test_warc_response_records(tmp_path):
    write_warc(tmp_path / "crawl.warc.gz", [
        ("request", "https://a.example/", None, None),
        ("response", "https://a.example/", "text/html; charset=utf-8", ARTICLE.encode()),
        ("response", "https://b.example/logo.png", "image/png", b"\x89PNG...."),
        ("response", "https://c.example/notes.txt", "text/plain", "plain notes about soil and compost".encode()),
        ("response", "https://d.example/huge", "text/html", b"<p>" + b"x" * 5000 + b"</p>"),
    ])
    ref = collect(tmp_path, ["*.warc.gz"], max_doc_bytes=4000)
    rows = ref.read().to_pylist()
    assert [r["url"] for r in rows] == ["https://a.example/", "https://c.example/notes.txt"]
    assert "Hellebores flower in January." in rows[0]["text"] and "About us" not in rows[0]["text"]
    assert rows[0]["source_id"].startswith("<urn:uuid:")
    meta = json.loads(rows[0]["meta"])
    assert meta["title"] == "Winter gardens" and meta["content_type"].startswith("text/html") and meta["warc_offset"] > 0
    assert rows[1]["text"] == "plain notes about soil and compost"
    rej = ref.read_rejected().to_pylist()
    assert [r["reason"] for r in rej] == ["unsupported_content_type", "too_large"]
    assert all("offset" in r["detail"] for r in rej)
    s = ref.manifest()["stats"]
    assert s["rows_in"] == 4 == s["rows_kept"] + s["rows_rejected"]  # the request record is not a document


@pytest.mark.parametrize("name", ["cut.warc", "cut.warc.gz"])
def test_truncated_warc_keeps_records_before_the_break(tmp_path, name):
    write_warc(tmp_path / "full", [
        ("response", f"https://e.example/{i}", "text/plain", f"page number {i} ".encode() * 50) for i in range(6)
    ], gz=name.endswith(".gz"))
    data = (tmp_path / "full").read_bytes()
    (tmp_path / "full").unlink()
    (tmp_path / name).write_bytes(data[: int(len(data) * 0.6)])
    ref = collect(tmp_path, [name])
    urls = [r["url"] for r in ref.read().to_pylist()]
    assert urls == [f"https://e.example/{i}" for i in range(len(urls))] and 1 <= len(urls) < 6
    [rej] = ref.read_rejected().to_pylist()
    assert rej["reason"] == "truncated_warc" and "offset" in rej["detail"]


def test_deep_json_empty_files_and_nul(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [
        json.dumps({"text": "ok one"}).encode(),
        b'{"text": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # beyond the parser's recursion limit
        json.dumps({"text": "nested meta", "x": [[[[[[[[1]]]]]]]]}).encode(),  # depth 9
        b'{"text": "a\\u0000b"}',
        json.dumps({"text": "ok two"}).encode(),
    ])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \n")
    with gzip.open(tmp_path / "empty.jsonl.gz", "wb"):
        pass
    (tmp_path / "empty.txt").write_bytes(b"")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    ref = collect(tmp_path, ["*.jsonl", "*.gz", "*.txt", "*.parquet"], max_json_depth=8)
    assert [r["text"] for r in ref.read().to_pylist()] == ["ok one", "ok two"]
    rej = sorted((r["source_id"].rsplit("/", 1)[-1], r["reason"]) for r in ref.read_rejected().to_pylist())
    assert rej == [("a.jsonl:2", "json_too_deep"), ("a.jsonl:3", "json_too_deep"), ("a.jsonl:4", "nul_bytes"),
                   ("blank.jsonl:0", "empty_file"), ("empty.jsonl.gz:0", "empty_file"),
                   ("empty.jsonl:0", "empty_file"), ("empty.parquet:0", "empty_file"), ("empty.txt:0", "empty_file")]
    # the default depth limit (64) accepts ordinary nesting
    assert collect(tmp_path, ["a.jsonl"]).num_rows == 3


def test_huge_document_rejected_with_bounded_memory(tmp_path):
    import tracemalloc

    big = "word " * 6_000_000  # a 30 MB document on one JSONL line
    with open(tmp_path / "big.jsonl", "w") as f:
        f.write(json.dumps({"text": "before"}) + "\n" + json.dumps({"id": "huge", "text": big}) + "\n")
        f.write(json.dumps({"text": "after"}) + "\n")
    (tmp_path / "big.txt").write_text(big)
    del big
    tracemalloc.start()
    ref = collect(tmp_path, ["big.*"], max_doc_bytes=1 << 20, max_line_bytes=2 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 12 << 20, f"peak {peak / 1e6:.1f} MB while reading a 30 MB line"
    assert [r["text"] for r in ref.read().to_pylist()] == ["before", "after"]
    rej = sorted((r["source_id"].rsplit("/", 1)[-1], r["reason"]) for r in ref.read_rejected().to_pylist())
    assert rej == [("big.jsonl:2", "too_large"), ("big.txt", "too_large")]
    # a document under the line limit but over max_doc_bytes is parsed, then rejected by its text size
    write_jsonl(tmp_path / "mid.jsonl", [json.dumps({"text": "y" * 3000}).encode()])
    mid = collect(tmp_path, ["mid.jsonl"], max_doc_bytes=2000, max_line_bytes=4000)
    assert [r["reason"] for r in mid.read_rejected().to_pylist()] == ["too_large"]


def test_size_limits_are_validated():
    with pytest.raises(ValueError, match="max_line_bytes"):
        CollectConfig(inputs=["x.jsonl"], max_doc_bytes=100, max_line_bytes=10)
