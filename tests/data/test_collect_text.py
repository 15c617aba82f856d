"""collect: reStructuredText, Markdown and plain text files, plain or compressed (.gz, .zst), one document each."""

import gzip

import pytest
import zstandard

from lifecycle.tasks.data.collect.stage import CollectConfig, InputError, run_collect

RST = "Kernel tuning\n=============\n\nThe scheduler picks the next task.\n"
MD = "# Kernel tuning\n\nThe scheduler picks the next task.\n\n* * *\n"


def collect(tmp_path, patterns, **kw):
    return run_collect(CollectConfig(inputs=[str(tmp_path / p) for p in patterns], **kw), str(tmp_path / "w"))


def test_text_markup_files_plain_and_compressed_are_one_document_each(tmp_path):
    (tmp_path / "a.rst").write_text(RST)
    (tmp_path / "b.md").write_text(MD)
    (tmp_path / "c.markdown").write_text(MD + "more\n")
    (tmp_path / "d.rst.gz").write_bytes(gzip.compress(RST.encode() + b"gz\n"))
    (tmp_path / "e.txt.gz").write_bytes(gzip.compress(b"plain text, gzipped\n"))
    (tmp_path / "f.md.zst").write_bytes(zstandard.ZstdCompressor().compress(MD.encode() + b"zst\n"))
    ref = collect(tmp_path, ["*"])
    rows = {r["source_id"].rsplit("/", 1)[-1]: r["text"] for r in ref.read().to_pylist()}
    assert rows == {"a.rst": RST, "b.md": MD, "c.markdown": MD + "more\n", "d.rst.gz": RST + "gz\n",
                    "e.txt.gz": "plain text, gzipped\n", "f.md.zst": MD + "zst\n"}
    assert ref.manifest()["num_rejected"] == 0


def test_broken_or_oversized_compressed_text_is_rejected_with_its_reason(tmp_path):
    whole = gzip.compress(RST.encode() * 50)
    (tmp_path / "cut.rst.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "bomb.txt.gz").write_bytes(gzip.compress(b"a" * 4096))  # 4 KiB once decompressed
    (tmp_path / "latin1.txt.gz").write_bytes(gzip.compress("caf\u00e9".encode("latin-1")))
    (tmp_path / "blank.md.gz").write_bytes(gzip.compress(b"  \n"))
    ref = collect(tmp_path, ["*.gz"], max_doc_bytes=1024, max_line_bytes=1024, max_memory_bytes=1 << 30)
    rej = {r["source_id"].rsplit("/", 1)[-1]: (r["reason"], r["detail"]) for r in ref.read_rejected().to_pylist()}
    assert {k: v[0] for k, v in rej.items()} == {"cut.rst.gz": "truncated_gzip", "bomb.txt.gz": "too_large",
                                                 "latin1.txt.gz": "invalid_utf8", "blank.md.gz": "empty_text"}
    assert rej["bomb.txt.gz"][1].endswith("more than max_doc_bytes=1024 bytes decompressed")
    assert ref.num_rows == 0


def test_an_unknown_compressed_type_is_refused_naming_the_types_it_takes(tmp_path):
    (tmp_path / "a.rst.bz2").write_bytes(b"BZh9")
    with pytest.raises(InputError, match=r"a\.rst\.bz2: unsupported input type .*\.txt/\.rst/\.md\[\.gz\|\.zst\]"):
        collect(tmp_path, ["*.bz2"])
