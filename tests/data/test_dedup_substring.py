"""Exact-substring dedup with suffix arrays (`dedup.substring`, tasks/data/dedup/substring.py): fires on planted
repeated spans (the first copy kept, later ones cut, the ranges exact), not below `min_length` nor on unique text,
never across documents; sharded equals one shard; reruns reused; the funnel and `lineage doc` show it; the default
config untouched."""

import json
import random

import numpy as np
import pyarrow as pa
import pytest

from lifecycle.cli import main
from lifecycle.lineage.charts import funnel_rows
from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
from lifecycle.tasks.data.dedup import substring as sub
from lifecycle.tasks.data.dedup.stage import DedupConfig, fingerprint_config, run_dedup

# the span planted in several documents: 120 bytes, unlike anything else in them
SPAN = ("Licensed under the Apache License, Version 2.0; you may not use this file except in compliance with the "
        "License. Thank you")
A = "the committee met on tuesday to discuss the budget for the coming year and agreed on new books."
B = "an entirely different document about river fishing licences and the rules for catching trout in spring!"
C = "completely unrelated prose about mountains glaciers valleys and the weather in the alps on a cold day?"
D = "a fourth text describing how the city council plans to repair the old bridge over the canal next summer"
ON = {"enabled": True, "min_length": 50}


def make(tmp_path, texts, name="in"):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"id": f"{name}{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return run_collect(CollectConfig(inputs=[str(p)]), str(tmp_path / "w"))


def cfg(**substring):
    return DedupConfig(near=False, incremental=False, substring={**ON, **substring})


def kept(ref):
    return {r["source_id"]: r for r in ref.read().to_pylist()}


def brute(texts: list[str], length: int) -> list[list[tuple[int, int]]]:
    """The definition, by brute force: every window of `length` bytes inside one document that occurred at an
    earlier position is cut; a document's cut bytes are the union of its cut windows."""
    seen, out = set(), []
    for t in texts:
        b = t.encode()
        cut = np.zeros(len(b) + 1, bool)
        for j in range(len(b) - length + 1):
            w = b[j : j + length]
            if w in seen:
                cut[j : j + length] = True
            seen.add(w)
        edges = np.flatnonzero(np.diff(np.concatenate([[False], cut]).astype(np.int8)))
        out.append([(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])])
    return out


def index_cuts(tmp_path, texts, length, shard_bytes):
    # model_construct: the kernel alone, at windows shorter than the config allows, so short texts have repeats
    s = sub.SuffixDedup(tmp_path / f"sa-{length}-{shard_bytes}", sub.SubstringConfig.model_construct(
        enabled=True, min_length=length, min_doc_chars=1, shard_bytes=shard_bytes))
    s.add(pa.array(texts))
    s.build()
    return s.cuts(np.array([len(t.encode()) for t in texts])), s.report()


# --------------------------------------------------------------------------------------------------
# the index alone


def test_index_matches_the_definition_for_any_shard_size(tmp_path):
    """Random short texts over a 4-letter alphabet (many repeats, repeats inside one document, periodic runs):
    the k-way merge over 1-byte shards (one per document), random shard sizes and one shard all give exactly the
    brute-force cuts."""
    rng = random.Random(0)
    for trial in range(60):
        length = rng.randint(2, 6)
        texts = ["".join(rng.choice("ab c") for _ in range(rng.randint(0, 30))) for _ in range(rng.randint(1, 8))]
        want = brute(texts, length)
        for shard_bytes in (1, rng.randint(2, 60), 1 << 20):
            got, _ = index_cuts(tmp_path / str(trial), texts, length, shard_bytes)
            assert got == want, (trial, length, shard_bytes, texts)


def test_no_window_crosses_a_document_boundary(tmp_path):
    """'xxxxyyyy' is in no single document but is the end of one and the start of the next, twice over: never
    matched. The same 8 bytes inside one document are."""
    texts = ["aaxxxx", "yyyybb", "ccxxxx", "yyyydd"]
    assert index_cuts(tmp_path, texts, 8, 1 << 20)[0] == [[], [], [], []]
    assert index_cuts(tmp_path, texts, 8, 1)[0] == [[], [], [], []]
    texts = ["aaxxxx", "yyyybb", "ccxxxxyyyydd", "zzxxxxyyyy"]
    assert index_cuts(tmp_path, texts, 8, 1)[0] == [[], [], [], [(2, 10)]]


def test_utf8_cuts_keep_whole_characters():
    b = "éé".encode()  # c3 a9 c3 a9
    assert sub.char_aligned(b, [(1, 3)]) == []  # inside the first character to inside the second: nothing whole
    assert sub.char_aligned(b, [(1, 4)]) == [(2, 4)]
    assert sub.char_aligned(b, [(0, 3)]) == [(0, 2)]
    # ranges in a text that lost [5, 10) already, back in the original's offsets, split around the earlier cut
    assert sub.to_original([(3, 7)], [{"start": 5, "end": 10}], 20) == [(3, 5), (10, 12)]
    assert sub.to_original([(0, 2)], [{"start": 0, "end": 4}], 9) == [(4, 6)]


# --------------------------------------------------------------------------------------------------
# the stage


def test_fires_on_a_planted_span_keeps_the_first_and_cuts_the_rest(tmp_path):
    texts = [A + SPAN + "; first.",     # in0: the first copy, kept whole
             B + SPAN + " second copy.",  # in1: SPAN cut exactly, text before and after kept
             SPAN + C,                 # in2: at the start
             SPAN,                     # in3: nothing else: emptied, rejected
             "é" + C.upper()]          # in4: unique (after a 2-byte character): untouched
    ref = run_dedup(make(tmp_path, texts), cfg(), str(tmp_path / "w"))
    k = kept(ref)
    assert list(k) == ["in0", "in1", "in2", "in4"]
    assert k["in0"]["text"] == texts[0] and k["in0"]["dedup_cuts"] == []
    assert k["in1"]["text"] == B + " second copy."
    assert k["in1"]["dedup_cuts"] == [{"start": len(B), "end": len(B) + len(SPAN), "reason": "substring"}]
    assert k["in2"]["text"] == C and k["in2"]["dedup_cuts"] == [{"start": 0, "end": len(SPAN), "reason": "substring"}]
    assert k["in4"]["text"] == texts[4] and k["in4"]["dedup_cuts"] == []
    (r,) = ref.read_rejected().to_pylist()
    assert (r["source_id"], r["reason"], r["duplicate_kind"], r["duplicate_of"]) == ("in3", "duplicate", "substring", None)
    assert r["detail"] == (f"1 spans ({len(SPAN)} of {len(SPAN)} bytes) of >= 50 bytes seen earlier in this run "
                           "(suffix array); 0 characters left, min_doc_chars 1")
    m = ref.manifest()
    assert m["stats"]["counters"] == {"substrings_cut": 3, "substring_bytes_cut": 3 * len(SPAN),
                                      "documents_trimmed_substring": 2, "duplicate_substring": 1}
    assert m["stats"]["rows_in"] == 5 == m["stats"]["rows_kept"] + m["stats"]["rows_rejected"]
    assert funnel_rows({"dedup": m})[0]["top_reasons"] == [("duplicate (substrings, suffix array)", 1)]
    assert m["substring"]["documents"] == 5 and m["substring"]["shards"] == 1
    assert m["substring"]["windows_repeated"] == 3 * (len(SPAN) - 50 + 1)


def test_does_not_fire_below_min_length_or_on_unique_text(tmp_path):
    wd = str(tmp_path / "w")
    parent = make(tmp_path, [A + SPAN, B + SPAN[:49] + " x", C])  # a 49-byte copy under min_length 50
    ref = run_dedup(parent, cfg(), wd)
    assert [r["dedup_cuts"] for r in ref.read().to_pylist()] == [[], [], []] and ref.read_rejected().num_rows == 0
    assert ref.manifest()["stats"].get("counters", {}) == {}
    assert [r["text"] for r in ref.read().to_pylist()] == [A + SPAN, B + SPAN[:49] + " x", C]
    # one byte longer than the copy: it fires at 49
    ref = run_dedup(parent, cfg(min_length=49), wd)
    assert kept(ref)["in1"]["dedup_cuts"] == [{"start": len(B), "end": len(B) + 49, "reason": "substring"}]


def test_min_doc_chars_rejects_a_document_left_short(tmp_path):
    ref = run_dedup(make(tmp_path, [A + SPAN, "tiny " + SPAN]), cfg(min_doc_chars=10), str(tmp_path / "w"))
    assert list(kept(ref)) == ["in0"]
    (r,) = ref.read_rejected().to_pylist()
    assert r["duplicate_kind"] == "substring" and r["detail"].endswith("4 characters left, min_doc_chars 10")


def test_sharded_equals_one_shard_and_reruns_are_reused(tmp_path):
    wd = str(tmp_path / "w")
    texts = [A + SPAN, B + SPAN + "x" + C, C + A, "Z" + SPAN + "Q" + D + "R" + SPAN, "é" + SPAN[:60] + "ü" + SPAN[60:]]
    parent = make(tmp_path, texts)
    one = run_dedup(parent, cfg(), wd)
    tiny = run_dedup(parent, cfg(shard_bytes=64), wd)  # shard size never enters the fingerprint: reused as is
    assert tiny.fingerprint == one.fingerprint and tiny.sha256 == one.sha256
    assert fingerprint_config(cfg(shard_bytes=64)) == fingerprint_config(cfg())
    # rebuilt for real with every document its own shard (the fingerprint dir removed): same bytes
    rows, rejected = one.read().to_pylist(), one.read_rejected().to_pylist()
    import shutil

    shutil.rmtree(one.dir)
    rebuilt = run_dedup(parent, cfg(shard_bytes=1), wd)
    assert rebuilt.read().to_pylist() == rows and rebuilt.read_rejected().to_pylist() == rejected
    assert rebuilt.sha256 == one.sha256 and rebuilt.manifest()["substring"]["shards"] == 5
    by_source = {r["source_id"]: r for r in rows}
    assert by_source["in3"]["text"] == "ZQ" + D + "R"  # repeated from earlier documents and inside this one
    assert by_source["in4"]["text"] == "éü" and [r["source_id"] for r in rejected] == ["in2"]  # C + A: all seen
    again = run_dedup(parent, cfg(shard_bytes=1), wd)
    assert again.fingerprint == rebuilt.fingerprint and again.dir.stat().st_mtime == rebuilt.dir.stat().st_mtime
    assert not list((tmp_path / "w" / "datasets" / "dedup").glob(".spill-*"))  # the scratch files are gone


def test_after_paragraph_dedup_ranges_are_in_the_original_offsets(tmp_path):
    footer = "this paragraph is a shared boilerplate footer that appears on many pages of the same site"
    texts = [A + "\n\n" + footer + "\n\n" + SPAN,
             B + "\n\n" + footer + "\n\n" + SPAN + " tail"]  # footer cut by the Bloom step, then SPAN by this
    c = DedupConfig(near=False, incremental=False, substring=ON, paragraphs={"enabled": True, "min_chars": 20})
    ref = run_dedup(make(tmp_path, texts), c, str(tmp_path / "w"))
    r = kept(ref)["in1"]
    start = len(B) + 2 + len(footer)  # "\n\n" + SPAN follows the footer in both: cut right after the paragraph
    assert r["dedup_cuts"] == [{"start": len(B), "end": start, "reason": "paragraph"},
                               {"start": start, "end": start + 2 + len(SPAN), "reason": "substring"}]
    assert r["text"] == B + " tail"
    original = texts[1].encode()
    pieces, pos = [], 0
    for cut in r["dedup_cuts"]:  # removing the recorded ranges from the original gives the kept text
        pieces.append(original[pos : cut["start"]])
        pos = cut["end"]
    assert b"".join(pieces + [original[pos:]]).decode() == r["text"]


def test_lineage_doc_shows_the_cuts(tmp_path, capsys):
    wd = tmp_path / "w"
    run_dedup(make(tmp_path, [A + SPAN, B + SPAN]), cfg(), str(wd))
    capsys.readouterr()
    assert main(["lineage", "doc", "in1", "--workdir", str(wd), "--json"]) == 0
    events = json.loads(capsys.readouterr().out)["events"]
    dedup = next(e for e in events if e["stage"] == "dedup")
    assert dedup["outcome"] == "kept"
    assert dedup["dedup_cuts"] == [{"start": len(B), "end": len(B) + len(SPAN), "reason": "substring"}]
    assert main(["lineage", "doc", "in1", "--workdir", str(wd)]) == 0
    assert "'reason': 'substring'" in capsys.readouterr().out


def test_default_config_has_no_substring_step(tmp_path):
    assert "substring" not in fingerprint_config(DedupConfig())
    assert fingerprint_config(DedupConfig(substring={"min_length": 70})) == fingerprint_config(DedupConfig())
    assert fingerprint_config(cfg())["substring"] == {"enabled": True, "min_length": 50, "min_doc_chars": 1}
    ref = run_dedup(make(tmp_path, [A + SPAN, B + SPAN]), DedupConfig(), str(tmp_path / "w"))
    assert "dedup_cuts" not in ref.read().column_names and "substring" not in ref.manifest()


def test_config_is_checked():
    with pytest.raises(ValueError, match="min_length"):
        DedupConfig(substring={"enabled": True, "min_length": 3})
    with pytest.raises(ValueError, match="shard_bytes"):
        DedupConfig(substring={"shard_bytes": 2**31})


def test_empty_parent(tmp_path):
    ref = run_dedup(make(tmp_path, [""]), cfg(), str(tmp_path / "w"))  # collect rejects the empty text: no files
    assert ref.num_rows == 0 and ref.manifest()["substring"]["bytes_indexed"] == 0
