"""Perplexity scorer: documents per second per core on the demo-size model.

    python -m bench.perplexity [--docs 256] [--json]

The model: deploy/configs/demo.yaml's architecture (4 layers, 4 heads, 128 wide, 128-token context) with the
vocabulary of a BPE the tokenize stage trains here on 200 pages of the bundled corpus (vocab_size 4096, as the
demo), packaged by the real checkpoint stage. Its weights are a seeded random init: throughput does not depend on
them. Documents: `--docs` pages of the bundled corpus, each scored over its first `max_tokens` (256, capped by the
128-token context: almost every page fills it).

Both ways on the same model, one torch thread, in the same run: the stage's `Scorer` (`batch_docs` 8 documents per
forward, sorted by length) against a plain loop of one forward per document (the peer). Prints one JSON line:
wall-clock docs/s (`docs_per_s_per_core`) and, steadier on a shared machine, docs per CPU-second of the process
(`docs_per_cpu_s`: one thread, so one core's time), with the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decontam import pages  # noqa: E402
from lifecycle.config import load_config  # noqa: E402
from tests.conftest import CORPUS, docs_table, make_collect  # noqa: E402


def package(tmp: str):
    """A demo-size GPT (random init) with its BPE, packaged as the checkpoint stage packages a trained one."""
    import torch

    from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, token_shards
    from lifecycle.tasks.eval.checkpoint.stage import package_model
    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train.model import GPT

    demo = load_config(ROOT / "deploy/configs/demo.yaml", [f"workdir={tmp}"])
    tokens = run_tokenize(make_collect(tmp, [docs_table(pages(CORPUS)[:200])]),
                          TokenizeConfig(vocab_size=demo.tokenize.vocab_size, val_fraction=0.05, min_val_docs=0,
                                         min_val_tokens=0), tmp)
    mcfg = demo.train.model.model_copy(update={"vocab_size": token_shards(tokens).vocab_size})
    torch.manual_seed(0)
    tag = Path(tmp) / "ckpt" / ckpt.tag_name(1)
    tag.mkdir(parents=True)
    ckpt.write_model(tag, GPT(mcfg).eval().export_state(), mcfg)
    ckpt.commit(tag, 1)
    return package_model(SimpleNamespace(checkpoint_dir=str(tag)), tokens, tmp), mcfg


def run(n_docs: int) -> dict:
    import torch
    import torch.nn.functional as F

    from lifecycle.tasks.eval.perplexity.stage import PerplexityConfig, Scorer, torch_threads

    docs = [p for p in pages(CORPUS) if p.strip()]
    docs = [docs[i % len(docs)] for i in range(n_docs)]
    with tempfile.TemporaryDirectory() as tmp:
        pkg, mcfg = package(tmp)
        cfg = PerplexityConfig(enabled=True, threads=1)
        with torch_threads(1):
            scorer = Scorer(pkg.dir, cfg)
            scorer.perplexities(docs[:8])  # warm-up: first-call allocations
            t0, c0 = time.perf_counter(), time.process_time()
            ours = scorer.perplexities(docs)
            ours_s, ours_cpu = time.perf_counter() - t0, time.process_time() - c0
            t0, c0 = time.perf_counter(), time.process_time()
            peer, seqs = [], []
            with torch.no_grad():
                for d in docs:  # the peer: one document at a time, tokenized and scored in one forward
                    s = scorer.ids([d])[0]
                    seqs.append(s)
                    x = torch.tensor([s[:-1]])
                    logits, _ = scorer.model(x)
                    peer.append(math.exp(F.cross_entropy(logits[0].float(), torch.tensor(s[1:])).item()))
            peer_s, peer_cpu = time.perf_counter() - t0, time.process_time() - c0
    agree = max(abs(a - b) / b for a, b in zip(ours, peer))
    return {"model": {k: getattr(mcfg, k) for k in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")},
            "docs": n_docs, "mean_tokens_scored": round(sum(len(s) - 1 for s in seqs) / n_docs, 1),
            "threads": 1, "docs_per_s_per_core": round(n_docs / ours_s, 1),
            "docs_per_cpu_s": round(n_docs / ours_cpu, 1),
            "peer_one_forward_per_doc_docs_per_s": round(n_docs / peer_s, 1),
            "peer_docs_per_cpu_s": round(n_docs / peer_cpu, 1), "ratio_vs_peer": round(peer_s / ours_s, 2),
            "ratio_vs_peer_cpu": round(peer_cpu / ours_cpu, 2),
            "max_rel_diff_vs_peer": float(f"{agree:.2e}"), "load_average": os.getloadavg()[0]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=256, help="documents scored")
    ap.add_argument("--json", action="store_true", help="(the output is one JSON line either way)")
    a = ap.parse_args(argv)
    print(json.dumps(run(a.docs)))


if __name__ == "__main__":
    main()
