"""`lineage model` names the model a scoring step scored with: the fastText classifier's file and sha256, or the
champion version perplexity used. Literal manifests, as the quality and perplexity steps write them."""

from lifecycle.lineage.cli import _scorer


def test_quality_and_perplexity_scorers_are_named():
    q = {"model_file": "quality.bin", "model_sha256": "ab" * 32}
    assert _scorer(q, "/w/datasets/quality/f1/_manifest.json") == {
        "kind": "fasttext", "file": "/w/datasets/quality/f1/quality.bin", "sha256": "ab" * 32}
    p = {"scoring_model": {"version": "3", "package_dir": "/w/datasets/checkpoint/c9", "package_sha256": "cd" * 32}}
    assert _scorer(p, "/w/datasets/perplexity/f2/_manifest.json") == {
        "kind": "champion", "version": "3", "package": "/w/datasets/checkpoint/c9", "sha256": "cd" * 32}
    assert _scorer({"stats": {}}, "/w/datasets/scrub/f3/_manifest.json") is None
