"""Quality classifier: held-out F1 and documents per second per core.

    python -m bench.quality [--docs 2000] [--json]

Reference (positives): the pages of the bundled Python-docs corpus's first file, written as a JSONL file and read
through `quality.reference_inputs` as the pipeline does. Corpus: the pages of the other files, each in one of
three low-quality forms (words shuffled; a keyword list of its own words; the page cut to its first 30 words and
wrapped in repeated spam boilerplate), since the bundle has no real low-quality web text; negatives are sampled
from that corpus by the quality step. The step itself trains the model (`run_quality`, the pipeline's code): F1,
precision and recall are its held-out figures (`heldout_fraction` of positives and negatives, never trained on).

Throughput: P(hq) of `--docs` corpus documents (cut to `max_chars`, 10,000), on one thread (fastText's predict
is single-threaded), two ways on the same model in the same run: the quality step's batched `predict` on a list
(ours) against one `predict` call per document (how datatrove's FastTextClassifierFilter calls it). The published
figure to beat: FineWeb-Edu's fastText classifier, "more than 2,000 docs/s on CPU"; our goal >= 5,000 docs/s/core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decontam import pages  # noqa: E402
from lifecycle.tasks.data.quality import classifier  # noqa: E402
from lifecycle.tasks.data.quality.stage import QualityConfig, run_quality  # noqa: E402
from tests.conftest import CORPUS, docs_table, make_collect  # noqa: E402

SPAM = ("Click here to subscribe! Best deals today, free shipping, limited offer. Share on Facebook Twitter. "
        "Cookies help us deliver our services. Related posts: top 10 tips you won't believe. ")


def degrade(page: str, i: int, rng: random.Random) -> str:
    w = page.split()
    if i % 3 == 0:
        rng.shuffle(w)
        return " ".join(w)
    if i % 3 == 1:
        return ", ".join(sorted(set(w))[:200])
    return SPAM * 3 + " ".join(w[:30]) + " " + SPAM * 3


def run(n_docs: int) -> dict:
    rng = random.Random(0)
    refs = pages(CORPUS[:1])
    corpus = [degrade(p, i, rng) for i, p in enumerate(pages(CORPUS[1:]))]
    with tempfile.TemporaryDirectory() as tmp:
        ref_file = Path(tmp) / "reference.jsonl"
        ref_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in refs))
        parent = make_collect(tmp, [docs_table(corpus)])
        cfg = QualityConfig(enabled=True, reference_inputs=[str(ref_file)], heldout_fraction=0.2)
        t0 = time.perf_counter()
        ref = run_quality(parent, cfg, tmp)
        step_s = time.perf_counter() - t0
        m = ref.manifest()
        import fasttext

        model = fasttext.load_model(str(ref.dir / m["model_file"]))
        docs = [corpus[i % len(corpus)] for i in range(n_docs)]
        t0 = time.perf_counter()  # the stage's whole scoring path: text to a fastText line, then batched predict
        for i in range(0, len(docs), cfg.batch_rows):
            classifier.hq_scores(model, [classifier.line_of(t, cfg.max_chars) for t in docs[i:i + cfg.batch_rows]])
        ours = n_docs / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in docs:  # the peer: one call per document, newlines replaced (datatrove's filter)
            model.predict(t[:cfg.max_chars].replace("\n", " "), k=-1)
        peer = n_docs / (time.perf_counter() - t0)
    return {"reference_docs": len(refs), "corpus_docs": len(corpus),
            "heldout": {k.removeprefix("classifier_"): v for k, v in m["metrics"].items()},
            "model_sha256": m["model_sha256"][:16], "quality_step_s": round(step_s, 2),
            "scored_docs": n_docs, "mean_doc_bytes": round(sum(len(t.encode()) for t in docs) / n_docs),
            "docs_per_s_per_core": round(ours), "peer_per_doc_predict_docs_per_s": round(peer),
            "ratio_vs_peer": round(ours / peer, 2), "published_fineweb_edu_docs_per_s": 2000, "goal": 5000,
            "load_average": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=2000, help="documents scored for the throughput figure")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = run(a.docs)
    if a.json:
        print(json.dumps(r, indent=2))
        return
    h = r["heldout"]
    print(f"held-out: precision {h['precision']:.3f} recall {h['recall']:.3f} F1 {h['f1']:.3f} "
          f"({h['heldout_docs']} docs; {r['reference_docs']} reference, {r['corpus_docs']} corpus)")
    print(f"throughput ({r['mean_doc_bytes']} B/doc, 1 thread): ours {r['docs_per_s_per_core']} docs/s, "
          f"per-document predict {r['peer_per_doc_predict_docs_per_s']} docs/s (x{r['ratio_vs_peer']}); "
          f"published 2,000, goal 5,000 (load average {r['load_average']:.2f})")


if __name__ == "__main__":
    main()
