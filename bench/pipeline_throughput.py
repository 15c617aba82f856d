"""Pipeline throughput: our collect -> filter -> dedup -> scrub (the real `lifecycle run ... --until scrub` CLI)
vs datatrove 0.10.1's equivalent pipeline on the same JSONL files with the same number of workers, plus dedup and
PII quality of both outputs measured against planted ground truth (issue 3, "Speed and scale").

Corpus (deterministic, seed 0): synthetic documents recombined from the paragraphs of the bundled corpus
(corpus/python-docs), written as `--files` plain JSONL files; among them planted near-duplicate pairs at the graded
word-edit rates of tests/test_dedup_quality.py (true 5-gram Jaccard computed per pair) and one generated PII value
per planted document from the generators of tests/test_scrub_eval.py (one kind per document, every kind).

Both sides run Gopher repetition + Gopher quality + C4 (filter_no_terminal_punct=False) + FineWeb, in FineWeb's
order, then MinHash dedup with 5-gram shingles and 14 bands x 8 rows, then PII replacement:
- ours: `lifecycle run CONFIG --until scrub --json` in a fresh work dir; language ID cannot be switched off (we
  keep every language, but py3langid still runs on every document), exact dedup runs before MinHash, the dedup
  index is off (`incremental: false`, datatrove has none), scrub replaces all eleven PII kinds. Timed: the data
  stages, from the Prefect log line that closes `resolve-inputs` to the `[scrub]` log line (Prefect task
  overhead and MLflow stage logging included); Prefect's temporary-server start is reported, not counted;
- datatrove: LocalPipelineExecutor: JsonlReader -> GopherRepetitionFilter -> GopherQualityFilter ->
  C4QualityFilter -> FineWebQualityFilter -> JsonlWriter -> MinhashDedupSignature; MinhashDedupBuckets (14 tasks,
  its minimum); MinhashDedupCluster (1 task, its only option); JsonlReader -> MinhashDedupFilter -> PIIFormatter
  (emails, public IPv4) -> JsonlWriter. tasks = workers = N except buckets and cluster. Timed: the four executors'
  `run()` inside the datatrove process (interpreter start and imports not counted). Workers start with `fork`
  instead of datatrove's default `forkserver`, so that their CPU time can be counted.

Quality, per side: a planted pair is "collapsed" when one of its two documents entered dedup and left it
removed (both documents must have passed the filters on that side); recall = collapsed share of pairs with
J >= 0.8, false merges = collapsed share of pairs with J <= 0.3. PII survival = share of planted values present
in the text that entered the PII step which are still in the final output (values the filters already removed,
e.g. private-key lines that C4 drops as too short, are not counted).

Run: `.venv/bin/python -m bench.pipeline_throughput [--workers 2] [--mb 24] [--reps 2]`
(datatrove venv: `bash bench/make_dtvenv.sh`; path from $DTVENV, default /tmp/dtvenv).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import numpy as np

from bench.datatrove_pipeline import DATATROVE_SCRIPT
from bench.filter_agreement import DTVENV, load_texts
from lifecycle.core.dataset import DatasetRef

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/test_dedup_quality.py imports its conftest as a top-level module
from tests.conftest import jaccard  # noqa: E402
from tests.data.test_dedup_quality import RATES, edit  # noqa: E402
from tests.data.test_scrub_eval import GENERATORS  # noqa: E402

PAIRS_PER_RATE = 80
PII_PER_KIND = 60



# --------------------------------------------------------------------------------------------------
# corpus with planted ground truth


def edit_keeping_lines(text: str, rate: float, rng: np.random.Generator) -> str:
    """tests/test_dedup_quality.py's word edits, with line breaks kept (as NUL words, which edits may hit too)."""
    return re.sub(r" ?\x00 ?", "\n", edit(text.replace("\n", " \x00 "), rate, rng))


def is_prose(paragraph: str) -> bool:
    """Prose, not code: >= 5 words, >= 90% of them with a letter, no `{` or `>>>`, ends like a sentence. The
    documentation's code paragraphs would make most synthetic documents fail Gopher's alphabetic-word rule, and
    little would reach dedup and PII."""
    words = paragraph.split()
    return (len(words) >= 5 and sum(any(c.isalpha() for c in w) for w in words) >= 0.9 * len(words)
            and "{" not in paragraph and ">>>" not in paragraph and paragraph.rstrip()[-1:] in ".!?:")


def build_corpus(out: Path, mb: float, files: int, seed: int = 0) -> dict:
    """Write `files` JSONL files of about `mb` MB; return the planted truth (pairs and PII values by doc id)."""
    r, rng = random.Random(seed), np.random.default_rng(seed)
    pool = list(dict.fromkeys(p.strip() for t in load_texts() for p in t.split("\n\n") if is_prose(p)))

    def synthetic() -> str:
        return "\n\n".join(r.sample(pool, r.randint(4, 10)))

    docs, pairs, pii = [], [], []
    for k in range(PAIRS_PER_RATE * len(RATES)):
        rate, base = RATES[k % len(RATES)], synthetic()
        copy = edit_keeping_lines(base, rate, rng)
        docs += [(f"pair{k}a", base), (f"pair{k}b", copy)]
        pairs.append((f"pair{k}a", f"pair{k}b", jaccard(base, copy)))
    for kind, gen in GENERATORS.items():
        for k in range(PII_PER_KIND):
            text, needle = gen(r)
            words = synthetic().split(" ")
            words.insert(r.randrange(1, len(words)), text)
            docs.append((f"pii-{kind}-{k}", " ".join(words)))
            pii.append((f"pii-{kind}-{k}", kind, needle))
    size = sum(len(t) for _, t in docs)
    while size < mb * 1e6:
        docs.append((f"bg{len(docs)}", synthetic()))
        size += len(docs[-1][1])
    r.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        with open(out / f"part-{i:05d}.jsonl", "w") as f:
            f.writelines(json.dumps({"id": d, "text": t}) + "\n" for d, t in docs[i::files])
    return {"pairs": pairs, "pii": pii, "docs": len(docs),
            "bytes": sum(p.stat().st_size for p in out.glob("*.jsonl"))}


# --------------------------------------------------------------------------------------------------
# the two sides; each returns (data seconds, extra info, {stage: {id: text}} for the quality measurement)


_LOG_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \|")


def _log_time(lines: list[str], marker: str) -> float:
    line = next(l for l in lines if marker in l and _LOG_TIME.match(l))
    t = datetime.strptime(_LOG_TIME.match(line).group(1), "%H:%M:%S.%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def timed_run(cmd: list[str], what: str, **kw) -> tuple[subprocess.CompletedProcess, dict]:
    """Run a command; wall seconds and CPU seconds (user + system, the command and every process it waited for).
    CPU time is less sensitive than wall time to other load on the machine and to the worker count."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    info = {"command_s": time.perf_counter() - t0, "cpu_s": _children_cpu() - cpu0}
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, info


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def ours_has_workers_key() -> bool:
    from lifecycle.config import OrchestrationConfig

    return "dask_workers" in OrchestrationConfig.model_fields


def run_ours(corpus: Path, wd: Path, workers: int) -> tuple[float, dict, dict]:
    cfg = {"name": "pipeline-throughput", "workdir": str(wd / "work"),
           "collect": {"inputs": [str(corpus / "*.jsonl")]},
           "filter": {"rules": ["gopher_repetition", "gopher_quality", "c4", "fineweb"]},
           "dedup": {"ngram": 5, "bands": 14, "rows": 8, "incremental": False}}
    path = wd / "config.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    cmd = [str(ROOT / ".venv" / "bin" / "lifecycle"), "run", str(path), "--until", "scrub", "--json"]
    if ours_has_workers_key():
        cmd += ["--set", f"orchestration.dask_workers={workers}"]
    proc, info = timed_run(cmd, "lifecycle run", cwd=ROOT)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # Prefect's timestamped lines are in the run's log file (the console shows one line per stage)
    lines = Path(summary["log"]).read_text(errors="replace").splitlines() if summary.get("log") else []
    lines += (proc.stdout + proc.stderr).splitlines()
    data_s = _log_time(lines, "[scrub] computed") - _log_time(lines, "Task run 'resolve-inputs")
    data_s += 86400 if data_s < 0 else 0

    def texts(stage: str) -> dict[str, str]:
        t = DatasetRef.from_dir(Path(summary["datasets"][stage]).parent).read(["source_id", "text"])
        return dict(zip(t.column("source_id").to_pylist(), t.column("text").to_pylist()))

    return data_s, info, {s: texts(s) for s in ("filter", "dedup", "scrub")}


def run_datatrove(corpus: Path, wd: Path, workers: int) -> tuple[float, dict, dict]:
    script = wd / "datatrove_pipeline.py"  # a file, not `-c`: the executor's forkserver workers re-import __main__
    script.write_text(DATATROVE_SCRIPT)
    proc, info = timed_run([str(DTVENV / "bin" / "python"), str(script), str(corpus), str(wd), str(workers)],
                           "datatrove")

    def texts(folder: str) -> dict[str, str]:
        out = {}
        for f in sorted((wd / folder).glob("*.jsonl")):
            out |= {d["id"]: d["text"] for d in map(json.loads, f.open())}
        return out

    filtered, output = texts("filtered"), texts("output")
    dedup_in_text = {i: filtered[i] for i in output}  # PIIFormatter drops nothing: its input is the dedup output
    seconds = json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]
    return seconds, info, {"filter": filtered, "dedup": dedup_in_text, "scrub": output}


# --------------------------------------------------------------------------------------------------
# quality against the planted truth


def quality(truth: dict, out: dict) -> dict:
    filt, dedup, final = out["filter"], out["dedup"], out["scrub"]
    hi, lo = [], []
    for a, b, j in truth["pairs"]:
        if a in filt and b in filt and (j >= 0.8 or j <= 0.3):
            (hi if j >= 0.8 else lo).append(a not in dedup or b not in dedup)
    seen, kept = defaultdict(int), defaultdict(int)
    for doc, kind, needle in truth["pii"]:
        if needle in dedup.get(doc, ""):
            seen[kind] += 1
            kept[kind] += needle in final.get(doc, "")
    return {"recall": (np.mean(hi), len(hi)), "false": (np.mean(lo), len(lo)),
            "pii": {k: (kept[k] / seen[k], seen[k]) for k in seen},
            "pii_all": (sum(kept.values()) / max(1, sum(seen.values())), sum(seen.values())),
            "rows": [len(filt), len(dedup), len(final)]}


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="workers on both sides (default 2)")
    ap.add_argument("--mb", type=float, default=24, help="corpus size in MB of text (default 24)")
    ap.add_argument("--files", type=int, default=8, help="input JSONL files (default 8)")
    ap.add_argument("--reps", type=int, default=2, help="alternating repetitions per side (default 2)")
    args = ap.parse_args(argv)
    if not (DTVENV / "bin" / "python").exists():
        print(f"pipeline throughput: SKIPPED, no datatrove venv at {DTVENV} (create it with bench/make_dtvenv.sh)")
        return
    n_ours = args.workers if ours_has_workers_key() else 1
    with tempfile.TemporaryDirectory(prefix="pipeline-throughput-") as tmp:
        corpus = Path(tmp) / "corpus"
        truth = build_corpus(corpus, args.mb, args.files)
        mb, docs = truth["bytes"] / 1e6, truth["docs"]
        print(f"pipeline throughput: {docs:,} docs, {mb:.1f} MB in {args.files} JSONL files; "
              f"{len(truth['pairs'])} planted pairs, {len(truth['pii'])} planted PII values; "
              f"workers: ours {n_ours}, datatrove {args.workers}")
        if n_ours != args.workers:
            print("  NOTE: `orchestration.dask_workers` is not in lifecycle/config.py yet: ours ran SERIALLY (1 worker) "
                  f"while datatrove had {args.workers}")
        times, extra, outs = defaultdict(list), defaultdict(list), {}
        for rep in range(args.reps):
            order = (("ours", run_ours), ("datatrove", run_datatrove))
            for side, fn in order if rep % 2 == 0 else order[::-1]:  # alternate who goes first
                wd = Path(tmp) / f"{side}-{rep}"
                wd.mkdir()
                s, info, outs[side] = fn(corpus, wd, args.workers)
                times[side].append(s)
                extra[side].append(info)
                print(f"  rep {rep + 1}: {side:<9} {s:7.1f} s data stages ({info['command_s']:.1f} s whole command, "
                      f"{info['cpu_s']:.1f} CPU s)", flush=True)
                shutil.rmtree(wd / "work", ignore_errors=True) if side == "ours" else None
        ratios = [d / o for o, d in zip(times["ours"], times["datatrove"])]
        q = {side: quality(truth, outs[side]) for side in ("ours", "datatrove")}

    def med(side):
        return statistics.median(times[side])

    sides = ("ours", "datatrove")
    print(f"\n  {'':<34} {'ours':>16} {'datatrove':>16}")
    print(f"  {'workers':<34} {n_ours:>16} {args.workers:>16}")
    print(f"  {'data-stage seconds (median)':<34} {med('ours'):>16.1f} {med('datatrove'):>16.1f}")
    for key, label in (("command_s", "whole command seconds (median)"), ("cpu_s", "whole command CPU s (median)")):
        print(f"  {label:<34} " + " ".join(f"{statistics.median(i[key] for i in extra[s]):>16.1f}" for s in sides))
    print(f"  {'docs/s':<34} {docs / med('ours'):>16,.0f} {docs / med('datatrove'):>16,.0f}")
    print(f"  {'MB/s':<34} {mb / med('ours'):>16.2f} {mb / med('datatrove'):>16.2f}")
    print(f"  {'rows after filter / dedup / PII':<34} {'/'.join(map(str, q['ours']['rows'])):>16} "
          f"{'/'.join(map(str, q['datatrove']['rows'])):>16}")

    def row(label: str, cells: list) -> None:  # cells: (share, count) or None
        print(f"  {label:<34} " + " ".join(f"{f'{c[0]:.3f} ({c[1]})' if c else 'n/a':>16}" for c in cells))

    row("dedup recall, J >= 0.8 (pairs)", [q[s]["recall"] for s in sides])
    row("false merges, J <= 0.3 (pairs)", [q[s]["false"] for s in sides])
    row("PII surviving, all kinds (values)", [q[s]["pii_all"] for s in sides])
    for kind in GENERATORS:
        row("  " + kind, [q[s]["pii"].get(kind) for s in sides])
    print(f"\n  throughput ratio ours/datatrove per rep: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}x (goal >= 2x at equal or better quality)")
    cpu = [d["cpu_s"] / o["cpu_s"] for o, d in zip(extra["ours"], extra["datatrove"])]
    print(f"  CPU-time ratio datatrove/ours, whole commands (ours' includes Prefect/MLflow start-up), per rep: "
          f"{', '.join(f'{x:.2f}' for x in cpu)}; median {statistics.median(cpu):.2f}x")


if __name__ == "__main__":
    main()
