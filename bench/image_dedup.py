"""Near-duplicate recall and false merges of image_dedup on the corpus's planted variants, per Hamming radius k.

    python -m bench.image_dedup [--k 4 6 8 10 12]

The corpus (corpus/build_images.py) plants 5 variants of each of its first 30 emoji (reencode, jpeg, resize, crop,
watermark), each naming its original in key.json. A variant counts as found when image_dedup drops it as a copy of
its original or of another variant of the same original (they are one cluster); a false merge is a dropped image
that is no variant (a distinct emoji merged into another) or a variant merged into another original's cluster.
image_collect and image_filter run once; image_dedup once per k (its committed datasets are reused on a rerun).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter

from lifecycle.tasks.data.images.collect.stage import ImageCollectConfig, run_image_collect
from lifecycle.tasks.data.images.dedup.stage import ImageDedupConfig, run_image_dedup
from lifecycle.tasks.data.images.filter import stage as image_filter

INPUTS = ["corpus/images/*.tar", "corpus/images/*.parquet"]


def origin(row: dict) -> str:
    """The emoji an image depicts: its own key, or the key its variant was made from."""
    meta = json.loads(row["meta"])
    return meta.get("variant_of") or row["source_id"].rsplit(":", 1)[1]


def score(kept_ref, k: int, blocks: int, workdir: str) -> dict:
    rows = {r["image_id"]: r for r in kept_ref.read(columns=["image_id", "source_id", "meta"]).to_pylist()}
    out = run_image_dedup(kept_ref, ImageDedupConfig(k=k, blocks=blocks), workdir)
    found, false, kinds = 0, 0, Counter()
    for r in out.read_rejected().to_pylist():
        me, other = rows[r["doc_id"]], rows[r["duplicate_of"]]
        kind = json.loads(me["meta"]).get("kind")
        if kind and origin(me) == origin(other):
            found += 1
            kinds[kind] += 1
        else:
            false += 1
    planted = Counter(json.loads(r["meta"]).get("kind") for r in rows.values())
    planted.pop(None, None)
    return {"k": k, "blocks": blocks, "planted": sum(planted.values()), "found": found,
            "recall": round(found / sum(planted.values()), 3), "false_merges": false, "images": len(rows),
            "recall_by_kind": {kd: f"{kinds[kd]}/{n}" for kd, n in sorted(planted.items())}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[4, 6, 8, 10, 12])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as wd:
        pairs = run_image_collect(ImageCollectConfig(enabled=True, inputs=INPUTS), wd)
        kept = image_filter.STAGE.run(pairs, image_filter.ImageFilterConfig(), wd)
        for k in args.k:
            print(json.dumps(score(kept, k, k + 2, wd)))


if __name__ == "__main__":
    main()
