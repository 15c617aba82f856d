"""Where training windows start (`train.batch.window_starts`, lifecycle.tasks.train.sampler): with `documents`
every window starts at a document's first token or a whole number of seq_len past it inside the document, the
windows at those starts cover every token of a shard, the draw is a pure function of (seed, step, sequence),
`lifecycle lineage step` reports what get_batch read, and a config.json that predates the field reads as
`anywhere`, the sampling of before."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lifecycle.lineage.steps import step_documents
from lifecycle.tasks.data.tokenize.stage import token_shards
from lifecycle.tasks.train import sampler
from lifecycle.tasks.train.config import TrainConfig
from lifecycle.tasks.train.loader import get_batch
from tests.train.test_train import CFG, make_tokens, with_

EOT = 0


def _shard(lengths: list[int], tail: int = 0) -> np.ndarray:
    """Documents of the given lengths (end-of-text included) end to end, then `tail` tokens of an unfinished one."""
    rng = np.random.default_rng(1)
    out = []
    for n in lengths:
        out += [*rng.integers(1, 50, size=n - 1), EOT]
    return np.array(out + list(rng.integers(1, 50, size=tail)), dtype=np.uint16)


def test_chunk_starts_are_document_starts_and_seq_len_past_them():
    tokens = _shard([3, 10, 4, 9], tail=5)  # documents at 0, 3, 13, 17; the unfinished one at 26
    assert sampler.chunk_starts(tokens, EOT, 4).tolist() == [0, 3, 7, 11, 13, 17, 21, 25, 26]  # 26 + 4 > 31 - 5
    assert sampler.chunk_starts(tokens, EOT, 40).size == 0  # shorter than one window
    assert sampler.chunk_starts(tokens[:3], EOT, 1).tolist() == [0, 1]  # a shard of one document


@pytest.mark.parametrize("seq_len", [1, 4, 7, 16])
def test_every_token_of_a_shard_is_in_some_window(seq_len):
    tokens = _shard([1, 2, 30, 5, 1, 17, 8, 3], tail=11)
    starts = sampler.chunk_starts(tokens, EOT, seq_len)
    covered = np.zeros(len(tokens), dtype=bool)
    for s in starts:
        assert s + seq_len + 1 <= len(tokens)  # a whole window
        covered[s:s + seq_len + 1] = True
    assert covered.all()
    boundary = np.concatenate(([0], np.flatnonzero(tokens == EOT) + 1))
    doc_of = np.searchsorted(boundary, starts, side="right") - 1
    chunked = (starts - boundary[doc_of]) % seq_len == 0
    assert chunked[:-1].all()  # all but possibly the last, pulled back to the shard's last whole window


def test_drawn_windows_start_at_a_boundary_or_chunk_and_depend_on_seed_step_and_index_only(tmp_path):
    shards = []
    for i, lengths in enumerate(([5, 40, 3, 12], [], [9, 9, 9, 9, 60], [2])):
        path = tmp_path / f"s{i}.bin"
        _shard(lengths).tofile(path)
        shards.append(np.memmap(path, dtype=np.uint16, mode="r") if lengths else np.zeros(0, np.uint16))
    T = 8
    allowed = [set(sampler.chunk_starts(d, EOT, T).tolist()) for d in shards]
    assert not allowed[3] and not allowed[1]  # too short: never drawn
    wins = sampler.step_windows("documents", shards, EOT, T, 7, 3, 0, 400)
    assert all(i in allowed[k] for k, i in wins)
    assert {k for k, _ in wins} == {0, 2}
    assert {i for k, i in wins if k == 2} == allowed[2]  # 400 draws over 14 starts reach them all
    assert wins[100:110] == sampler.step_windows("documents", shards, EOT, T, 7, 3, 100, 10)  # any split
    assert wins != sampler.step_windows("documents", shards, EOT, T, 7, 4, 0, 400)
    assert wins != sampler.step_windows("documents", shards, EOT, T, 8, 3, 0, 400)
    # `anywhere` is the sampling of before, unchanged
    assert sampler.step_windows("anywhere", shards, EOT, T, 7, 3, 0, 50) == sampler.windows(
        [len(d) for d in shards], T, 7, 3, 0, 50)


def test_a_config_that_predates_the_field_reads_as_anywhere_and_the_field_is_in_the_fingerprint():
    docs = with_(CFG, **{"batch.window_starts": "documents"})
    new = docs.model_dump(mode="json")
    old = {**new, "batch": {k: v for k, v in new["batch"].items() if k != "window_starts"}}
    assert sampler.window_mode(new) == "documents" and sampler.window_mode(old) == "anywhere"
    assert TrainConfig.model_validate(old).batch.window_starts == "anywhere" == CFG.batch.window_starts
    assert docs.run_key() != CFG.run_key()
    # the checkpoint's sampler state of before is what `anywhere` writes; `documents` is another sampler
    assert sampler.sampler_state(CFG, 5, 2)["kind"] == "uniform_windows"
    assert sampler.sampler_state(docs, 5, 2)["kind"] == "document_windows"
    with pytest.raises(ValueError, match="window_starts"):
        with_(CFG, **{"batch.window_starts": "boundaries"})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    wd = tmp_path_factory.mktemp("windows")
    ref = make_tokens(wd, 300)
    return wd, token_shards(ref)


def test_the_lineage_step_reports_the_document_windows_get_batch_reads(world):
    wd, shards = world
    cfg = with_(CFG, **{"batch.grad_accum": 2, "batch.window_starts": "documents"})
    d = wd / "train" / "docs"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"train": cfg.model_dump(mode="json"), "tokens": shards.model_dump(),
                                               "run_dir": str(d)}))
    r = step_documents(d, 3)
    data = {p.split("/")[-1]: np.fromfile(p, dtype=shards.dtype) for p in shards.train}
    T, at_boundary = cfg.model.seq_len, 0
    for s in r["sequences"]:
        x, y = get_batch(shards, cfg, 2, s["dp_rank"], s["micro"])
        row = s["sequence"] % cfg.batch.micro_batch_size
        tokens = data[s["shard"]]
        window = tokens[s["token_start"]:s["token_end"]]
        assert np.array_equal(window[:T], x[row].numpy()) and np.array_equal(window[1:], y[row].numpy())
        assert s["token_start"] in set(sampler.chunk_starts(tokens, shards.eot_id, T).tolist())
        at_boundary += s["token_start"] == 0 or tokens[s["token_start"] - 1] == shards.eot_id
    assert at_boundary > len(r["sequences"]) // 2  # the demo-like documents are shorter than a window
    # the same run under `anywhere` reads other windows
    (d / "config.json").write_text(json.dumps({"train": CFG.model_dump(mode="json"), "tokens": shards.model_dump(),
                                               "run_dir": str(d)}))
    assert [s["token_start"] for s in step_documents(d, 3)["sequences"][:16]] != [
        s["token_start"] for s in r["sequences"][:16]]
