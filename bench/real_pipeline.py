"""Data preparation on a real corpus vs datatrove, start-up included (issue 25).

    python -m bench.real_pipeline [--mb 24] [--reps 2] [--workers 2]      # ours vs datatrove, one JSON line last
    python -m bench.real_pipeline --scaling 24,240,2400 [--plots docs/img] # ours alone: docs/s, peak memory per size

Corpus: bench/real_corpus.py (man pages, generated man pages, translated man pages, package docs in text and HTML,
pydoc, Python source, Go's and the kernel's source trees; one seeded shuffle, so every size has the same mix; seed
0), built once per size under `--cache` (default /tmp/real-corpus) and reused.

Both sides run Gopher repetition, Gopher quality, C4 (filter_no_terminal_punct=False) and FineWeb in FineWeb's
order, MinHash dedup (5-gram shingles, 14 bands x 8 rows), then PII replacement, with `--workers` workers:
- ours: `lifecycle run CONFIG --until scrub --json` as a subprocess in a fresh work dir (embedded Prefect server
  started from the migrated database template when one is cached, `prefect_template` says whether it was;
  imports and shutdown included; exact dedup before MinHash, dedup index off as datatrove has none);
- datatrove 0.10.1: bench/pipeline_throughput.py's pipeline script run by its own interpreter (start included).
Sides alternate over `--reps`; each run's wall time is the outside clock around the whole command, its peak
memory the largest sum of RSS over the command's process tree, sampled every 0.1 s, and the same for PSS (every 0.5 s) (which
counts a page shared by forked processes once: the truer figure for both sides, which both fork workers). Fixed overhead of ours
(command -> first stage, last stage -> exit) comes from the run summary's `timing` (epoch seconds, written by the
flow) and the outside clock; it is null when the summary has no `timing`.

The per-stage profile runs ours' stage entry points in this process, one worker, on the same corpus: docs/s per
worker for each stage, and inside filter, per rule family, how many documents reach it (rules stop at the first
failure), its seconds and docs/s, and language ID on the kept documents (their `lang` columns).

datatrove venv: `bash bench/make_dtvenv.sh`; path from $DTVENV, else /tmp/dtvenv or /tmp/wt-filter-dtvenv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ["gopher_repetition", "gopher_quality", "c4", "fineweb"]
PAGE = os.sysconf("SC_PAGE_SIZE")


def dtvenv() -> Path:
    if os.environ.get("DTVENV"):
        return Path(os.environ["DTVENV"])
    return next((p for p in map(Path, ("/tmp/dtvenv", "/tmp/wt-filter-dtvenv")) if (p / "bin/python").exists()),
                Path("/tmp/dtvenv"))


def corpus(cache: Path, mb: float, mix: str = "crawl", seed: int = 0) -> tuple[Path, dict]:
    """bench/real_corpus.py's corpus of `mb` MB in `mix`, built once under `cache` and reused."""
    from bench.real_corpus import build

    out = cache / f"{mix}-mb{mb:g}-seed{seed}"
    if not (out / "corpus.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        build(out, mb, seed=seed, mix=mix)
    return out, json.loads((out / "corpus.json").read_text())


# --------------------------------------------------------------------------------------------------
# one command, timed from outside, with its process tree's peak RSS


def role(pid: int, root: int) -> str:
    """What a process of the measured tree is, from its command line: `command` (the measured process itself: our
    CLI and flow, or datatrove's main), `server` (an embedded Prefect server, uvicorn), `workers` (multiprocessing's
    forkserver, pool workers and shard processes forked from them), `other: <command line>`."""
    if pid == root:
        return "command"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return "other"
    if b"flows.startup" in cmd or b"prefect" in cmd or b"uvicorn" in cmd:
        return "server"
    if b"multiprocessing" in cmd or b"datatrove_pipeline.py" in cmd:  # forkserver or a fork of the command
        return "workers"
    return f"other: {cmd.decode(errors='replace').strip()[:60]}"


def tree_memory(root: int, pss: bool = True) -> tuple[int, int, dict[str, int]]:
    """(RSS, PSS, {role: PSS}) in bytes of `root` and all its descendants now (from /proc; roles: `role`). RSS counts
    a page once per process that maps it, so forked workers and shard processes that share their parent's pages
    (copy-on-write: the interpreter, the language-ID model, numba's code) are counted several times; PSS divides
    each shared page among the processes that map it, so the tree's PSS is the memory the run really holds."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(d))
    want_pss, rss = pss, 0
    roles: dict[str, int] = defaultdict(int)
    stack = [root]
    while stack:
        pid = stack.pop()
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            if want_pss:
                roles[role(pid, root)] += next(int(line.split()[1]) * 1024 for line in
                                               Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                                               if line.startswith("Pss:"))
        except (OSError, IndexError, ValueError, StopIteration):
            pass
        stack.extend(children.get(pid, ()))
    return rss, sum(roles.values()), dict(roles)


def measured(cmd: list[str], what: str, also: tuple[int, ...] = (), **kw) -> tuple[str, dict]:
    """Run `cmd`; (stdout, {start, end (epoch s), wall_s, peak_rss_mb, peak_pss_mb, pss_timeline}) (each peak the
    tree's largest sum, sampled every 0.1 s, PSS every 0.5 s; `pss_timeline`: [(epoch s, PSS MB, {role: MB})] at
    each PSS sample; `also`: the trees of these pids are added, e.g. the warm runner that does the work of a
    `lifecycle run` against `lifecycle up`). Raises with the output on failure."""
    start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    peak, done, timeline = [0, 0], threading.Event(), []

    def trees(pss: bool) -> tuple[int, int, dict[str, int]]:
        rss, total, roles = tree_memory(proc.pid, pss=pss)
        for pid in also:
            r, p, more = tree_memory(pid, pss=pss)
            rss, total = rss + r, total + p
            for k, v in more.items():
                roles[k] = roles.get(k, 0) + v
        return rss, total, roles

    def sample() -> None:  # PSS every 5th sample: smaps_rollup walks each process's page tables under its mm lock
        n = 0
        while not done.is_set():
            rss, pss, roles = trees(n % 5 == 0)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            if n % 5 == 0:
                timeline.append((time.time(), pss / 1e6, {k: v / 1e6 for k, v in roles.items()}))
            n += 1
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
    return out, {"start": start, "end": start + wall, "wall_s": wall, "peak_rss_mb": peak[0] / 1e6,
                 "peak_pss_mb": peak[1] / 1e6, "pss_timeline": timeline}


def memory_by_stage(info: dict) -> dict:
    """Peak PSS (MB) of the tree and of each role in each phase of a run of ours: `before` (command to first stage),
    each stage (from `stage_start:<name>` to the next phase), `after` (last stage to exit)."""
    t = info["timing"]
    starts = sorted((v, k.split(":", 1)[1]) for k, v in t.items() if k.startswith("stage_start:"))
    if not starts:
        return {}
    bounds = [(info["start"], "before")] + starts + [(t["last_stage_end"], "after")]
    out: dict[str, dict] = {}
    for when, pss, roles in info["pss_timeline"]:
        phase = next((name for (a, name), (b, _) in zip(bounds, bounds[1:] + [(float("inf"), "")]) if a <= when < b),
                     None)
        if phase is None:
            continue
        cur = out.setdefault(phase, {"peak_mb": 0.0, "roles_at_peak": {}, "role_peaks_mb": {}})
        if pss > cur["peak_mb"]:
            cur["peak_mb"], cur["roles_at_peak"] = round(pss, 1), {k: round(v, 1) for k, v in roles.items()}
        for k, v in roles.items():
            cur["role_peaks_mb"][k] = round(max(cur["role_peaks_mb"].get(k, 0.0), v), 1)
    return out


def ours_config(src: Path, wd: Path) -> dict:
    return {"name": "real-pipeline", "workdir": str(wd / "work"),
            "collect": {"inputs": [str(src / "*.jsonl.gz")]},
            "filter": {"rules": RULES},
            "dedup": {"minhash": {"ngram": 5, "bands": 14, "rows": 8}, "incremental": False}}


def run_ours(src: Path, wd: Path, workers: int, keep_server: bool = False, sets: list[str] = (),
             also: tuple[int, ...] = ()) -> dict:
    """One `lifecycle run` in `wd/work`. `keep_server`: leave its embedded Prefect server (or `lifecycle up`'s
    servers) running for the next run in the same work dir (--recurring, --up), and recompute every stage there
    (its datasets are removed first). `also`: pids whose memory counts as the run's (the warm runner)."""
    shutil.rmtree(wd / "work" / "datasets", ignore_errors=True)
    path = wd / "config.yaml"
    path.write_text(json.dumps(ours_config(src, wd)))  # JSON is YAML
    cmd = [str(ROOT / ".venv/bin/lifecycle"), "run", str(path), "--until", "scrub", "--json",
           "--set", f"orchestration.dask_workers={workers}", *(a for kv in sets for a in ("--set", kv))]
    from lifecycle.flows.startup.template import template_path

    template = template_path()
    had_template = template is not None and template.exists()
    out, info = measured(cmd, "lifecycle run", also=also, cwd=wd)
    info["prefect_template"] = had_template  # False: this run's new server migrated its database (~10 s more)
    # not timed: stop the embedded Prefect server the run started in this throwaway work dir (it would idle an hour)
    if not keep_server:
        stop_server(wd)
    summary = json.loads(out.strip().splitlines()[-1])
    t = summary.get("timing") or {}
    first, last = t.get("first_stage_start"), t.get("last_stage_end")
    info["to_first_stage_s"] = first - info["start"] if first is not None else None
    info["after_last_stage_s"] = info["end"] - last if last is not None else None
    info["stages_s"] = {k.split(":", 1)[1]: v for k, v in t.items() if k.startswith("stage:")}
    info["rows"] = {s: json.loads(Path(m).read_text()).get("num_rows") for s, m in summary["datasets"].items()}
    info["timing"] = t
    info["memory_by_stage"] = memory_by_stage(info)
    return info


def start_servers(wd: Path) -> int:
    """`lifecycle up` for `wd/work` (Prefect and MLflow servers and the warm runner, on free ports); the
    runner's pid."""
    from lifecycle.core.procs import free_port

    (wd / "work").mkdir(parents=True, exist_ok=True)
    subprocess.run([str(ROOT / ".venv/bin/lifecycle"), "up", "--workdir", str(wd / "work"), "--prefect-port",
                    str(free_port()), "--mlflow-port", str(free_port())], cwd=wd, check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    return json.loads((wd / "work" / ".servers" / "servers.json").read_text())["runner"]["pid"]


def wait_embedded_runner(wd: Path) -> int:
    """The pid of the warm runner the first (cold) run left beside the work dir's embedded server, once it answers
    (untimed: a user's next run comes an hour later)."""
    from lifecycle.flows.startup.embedded_runner import wait_embedded_runner as wait

    if (entry := wait(wd / "work")) is None:
        raise RuntimeError(f"no embedded runner answered for {wd / 'work'} (LIFECYCLE_EMBEDDED_RUNNER=0?)")
    return entry["pid"]


def stop_server(wd: Path) -> None:
    subprocess.run([str(ROOT / ".venv/bin/lifecycle"), "down", "--workdir", str(wd / "work")], cwd=wd, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


def run_datatrove(src: Path, wd: Path, workers: int) -> dict:
    from bench.datatrove_pipeline import DATATROVE_SCRIPT

    script = wd / "datatrove_pipeline.py"  # a file: the executor's workers re-import __main__
    script.write_text(DATATROVE_SCRIPT)
    out, info = measured([str(dtvenv() / "bin/python"), str(script), str(src), str(wd), str(workers)], "datatrove")
    info["in_process_s"] = json.loads(out.strip().splitlines()[-1])["seconds"]
    info["rows_out"] = sum(1 for f in (wd / "output").glob("*.jsonl") for _ in f.open())
    return info


# --------------------------------------------------------------------------------------------------
# in-process per-stage profile (one worker)


def profile(src: Path, wd: Path) -> dict:
    """Each data stage's seconds and docs/s on one worker, and inside filter each rule family's share."""
    from lifecycle.config import PipelineConfig
    from lifecycle.tasks.data.collect.stage import run_collect
    from lifecycle.tasks.data.dedup.stage import run_dedup
    from lifecycle.tasks.data.filter.language import detect_language
    from lifecycle.tasks.data.filter.words import split_words
    from lifecycle.tasks.data.filter.stage import run_filter
    from lifecycle.tasks.data.scrub.stage import run_scrub

    cfg = PipelineConfig.model_validate(ours_config(src, wd))
    work = str(wd / "work")
    stages, refs = {}, {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        ref = fn(*args)
        s = time.perf_counter() - t0
        n_in = refs[list(refs)[-1]].num_rows if refs else ref.manifest().get("stats", {}).get("rows_in", ref.num_rows)
        stages[name] = {"seconds": s, "docs_in": n_in, "docs_out": ref.num_rows, "docs_per_s": n_in / s}
        refs[name] = ref

    timed("collect", run_collect, cfg.collect, work)
    timed("filter", run_filter, refs["collect"], cfg.filter, work)
    timed("dedup", run_dedup, refs["filter"], cfg.dedup, work)
    timed("scrub", run_scrub, refs["dedup"], cfg.scrub, work)

    # inside filter: the stage's lazy loop, timed per step
    texts = refs["collect"].read(["text"]).column("text").to_pylist()
    fam = defaultdict(lambda: {"docs": 0, "seconds": 0.0, "rejected": 0})
    for text in texts:
        original, words, kept = text, None, True
        for name, rule in zip(cfg.filter.rules, cfg.filter.active()):
            if words is None and rule.uses_words:
                t0 = time.perf_counter()
                words = split_words(text)
                fam["split_words"]["seconds"] += time.perf_counter() - t0
                fam["split_words"]["docs"] += 1
            t0 = time.perf_counter()
            v = rule.reason(text, words)
            new = text if v else rule.edit(text)
            fam[name]["seconds"] += time.perf_counter() - t0
            fam[name]["docs"] += 1
            if v:
                fam[name]["rejected"] += 1
                kept = False
                break
            if new != text:
                text, words = new, None
        if kept:
            t0 = time.perf_counter()
            detect_language(original)
            fam["language_id (kept docs)"]["seconds"] += time.perf_counter() - t0
            fam["language_id (kept docs)"]["docs"] += 1
    for f in fam.values():
        f["docs_per_s"] = f["docs"] / f["seconds"] if f["seconds"] else None
    return {"stages": stages, "filter_rules": dict(fam)}


def print_profile(p: dict) -> None:
    print("\n  per-stage profile (ours, one worker, in process)")
    print(f"  {'stage':<26} {'docs in':>9} {'docs out':>9} {'seconds':>9} {'docs/s/worker':>14}")
    for name, s in p["stages"].items():
        print(f"  {name:<26} {s['docs_in']:>9,} {s['docs_out']:>9,} {s['seconds']:>9.2f} {s['docs_per_s']:>14,.0f}")
    total = sum(f["seconds"] for f in p["filter_rules"].values()) or 1
    print("\n  inside filter (lazy: a rule sees only the documents every earlier rule passed)")
    print(f"  {'rule family':<26} {'docs in':>9} {'rejected':>9} {'seconds':>9} {'docs/s/worker':>14} {'share':>7}")
    for name, f in p["filter_rules"].items():
        print(f"  {name:<26} {f['docs']:>9,} {f['rejected']:>9,} {f['seconds']:>9.2f} "
              f"{f['docs_per_s'] or 0:>14,.0f} {f['seconds'] / total:>6.0%}")


# --------------------------------------------------------------------------------------------------


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mode_of(args) -> str:
    if args.up:
        return "lifecycle up: same work dir, servers and warm runner up (their memory: the runner's counted)"
    if args.recurring:
        return "recurring: same work dir, embedded server and its warm runner up (the runner's memory counted)"
    return "new work dir"


def compare(args) -> None:
    if not (dtvenv() / "bin/python").exists():
        raise SystemExit(f"no datatrove venv at {dtvenv()} (create it with bench/make_dtvenv.sh, or set $DTVENV)")
    src, meta = corpus(args.cache, args.mb, args.mix or "crawl")
    docs, mb = meta["documents"], meta["text_bytes"] / 1e6
    print(f"real pipeline: {docs:,} docs, {mb:.1f} MB of text in {src}; {args.workers} workers both sides; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    runs = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="real-pipeline-") as tmp:
        order = (("ours", run_ours), ("datatrove", run_datatrove))
        home = Path(tmp) / "ours-same-dir"
        same_dir, runner = args.recurring or args.up, ()
        if same_dir:  # one untimed run starts the work dir's server (or warms `up`'s runner) and creates its stores
            home.mkdir()
            if args.up:
                runner = (start_servers(home),)
            run_ours(src, home, args.workers, keep_server=True, sets=args.set, also=runner)
            if args.recurring:  # the embedded server's warm runner, which that run started as it exited
                runner = (wait_embedded_runner(home),)
        for rep in range(args.reps):
            for side, fn in order if rep % 2 == 0 else order[::-1]:
                if side == "ours" and same_dir:
                    info = run_ours(src, home, args.workers, keep_server=True, sets=args.set, also=runner)
                    runs[side].append(info)
                    print(f"  rep {rep + 1}: ours      {info['wall_s']:7.1f} s wall, peak RSS {info['peak_rss_mb']:,.0f} MB, "
                          f"PSS {info['peak_pss_mb']:,.0f} MB, to first stage {info['to_first_stage_s']:.2f}, after last stage "
                          f"{info['after_last_stage_s']:.2f} ({mode_of(args)})", flush=True)
                    continue
                wd = Path(tmp) / f"{side}-{rep}"
                wd.mkdir()
                info = fn(src, wd, args.workers)
                runs[side].append(info)
                extra = (f", to first stage {info['to_first_stage_s']:.2f}, after last stage "
                         f"{info['after_last_stage_s']:.2f}, Prefect db template {info['prefect_template']}"
                         if side == "ours" else "")
                print(f"  rep {rep + 1}: {side:<9} {info['wall_s']:7.1f} s wall, peak RSS {info['peak_rss_mb']:,.0f} MB, "
                      f"PSS {info['peak_pss_mb']:,.0f} MB{extra}", flush=True)
                shutil.rmtree(wd, ignore_errors=True)
        if same_dir:
            stop_server(home)
        prof = None if args.no_profile else profile(src, Path(tmp) / "profile")
    ratios = [d["wall_s"] / o["wall_s"] for o, d in zip(runs["ours"], runs["datatrove"])]
    if prof:
        print_profile(prof)
    if not ratios:  # --reps 0: the profile alone
        print(json.dumps({"bench": "real_pipeline_profile", "mb": round(mb, 1), "documents": docs, "profile": prof,
                          "load_avg": os.getloadavg()[0]}))
        return
    ours, dt = runs["ours"], runs["datatrove"]
    result = {
        "bench": "real_pipeline", "sets": args.set, "mix": args.mix or "crawl", "mb": round(mb, 1), "documents": docs, "workers": args.workers, "reps": args.reps,
        "ours_mode": mode_of(args),
        "ratio": med(ratios), "ratios": [round(r, 3) for r in ratios],
        "ours_wall_s": med([r["wall_s"] for r in ours]), "datatrove_wall_s": med([r["wall_s"] for r in dt]),
        "ours_docs_per_s": docs / med([r["wall_s"] for r in ours]),
        "datatrove_docs_per_s": docs / med([r["wall_s"] for r in dt]),
        "ours_peak_rss_mb": max(r["peak_rss_mb"] for r in ours),
        "datatrove_peak_rss_mb": max(r["peak_rss_mb"] for r in dt),
        "ours_peak_pss_mb": max(r["peak_pss_mb"] for r in ours),  # shared pages counted once: see tree_memory
        "datatrove_peak_pss_mb": max(r["peak_pss_mb"] for r in dt),
        "command_to_first_stage_s": med([r["to_first_stage_s"] for r in ours]),
        "last_stage_to_exit_s": med([r["after_last_stage_s"] for r in ours]),
        "prefect_template": [r["prefect_template"] for r in ours],
        "ours_stages_s": ours[-1]["stages_s"] or None, "ours_rows": ours[-1]["rows"],
        "datatrove_rows_out": dt[-1]["rows_out"], "datatrove_in_process_s": med([r["in_process_s"] for r in dt]),
        "profile": prof, "load_avg": os.getloadavg()[0],
    }
    print(json.dumps(result))


def scaling(args) -> None:
    sizes = [float(x) for x in args.scaling.split(",") if x]
    points = []
    for mb in sizes:
        src, meta = corpus(args.cache, mb, args.mix or "uniform")
        with tempfile.TemporaryDirectory(prefix="real-pipeline-scaling-") as tmp:
            info = run_ours(src, Path(tmp), args.workers, sets=args.set)
        point = {"mb": meta["text_bytes"] / 1e6, "target_mb": mb, "documents": meta["documents"],
                 "wall_s": info["wall_s"], "docs_per_s": meta["documents"] / info["wall_s"],
                 "mb_per_s": meta["text_bytes"] / 1e6 / info["wall_s"],
                 "stage_docs_per_s": (meta["documents"] / sum(info["stages_s"].values())
                                      if info["stages_s"] else None),
                 "peak_rss_mb": info["peak_rss_mb"], "peak_pss_mb": info["peak_pss_mb"], "load_avg": os.getloadavg()[0], "note": meta.get("note"),
                 "stages_s": info["stages_s"], "memory_by_stage": info["memory_by_stage"]}
        if points:  # the cost of the extra documents alone: what a linear cost keeps constant
            prev = points[-1]
            point["marginal_docs_per_s"] = (point["documents"] - prev["documents"]) / (point["wall_s"] - prev["wall_s"])
            point["marginal_mb_per_s"] = (point["mb"] - prev["mb"]) / (point["wall_s"] - prev["wall_s"])
        points.append(point)
        print(f"  {point['mb']:8.1f} MB {point['documents']:>9,} docs {point['wall_s']:8.1f} s "
              f"{point['docs_per_s']:8.1f} docs/s {point['peak_rss_mb']:8,.0f} MB peak RSS "
              f"{point['peak_pss_mb']:8,.0f} MB peak PSS", flush=True)
        for phase, m in point["memory_by_stage"].items():
            print(f"      {phase:<8} peak PSS {m['peak_mb']:8,.0f} MB  at peak: "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(m["roles_at_peak"].items())), flush=True)
    result = {"bench": "real_pipeline_scaling", "mix": args.mix or "uniform", "workers": args.workers,
              "sets": args.set, "linear_fit": linear_fit(points), "points": points}
    print(json.dumps(result), flush=True)
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        (args.plots / "real_pipeline_scaling.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(points, args.plots)
        plot_memory({"this run": points}, args.plots)


def linear_fit(points: list[dict]) -> dict | None:
    """wall = fixed_s + documents / docs_per_s, least squares over the points: a cost that grows linearly has
    one docs/s for the documents beyond the fixed cost at every size; `marginal_spread` is how far the marginal
    docs/s between consecutive sizes differ (max / min - 1)."""
    if len(points) < 2:
        return None
    n = len(points)
    xs, ys = [p["documents"] for p in points], [p["wall_s"] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    marginal = [p["marginal_docs_per_s"] for p in points if p.get("marginal_docs_per_s")]
    return {"fixed_s": round(my - slope * mx, 2), "docs_per_s": round(1 / slope, 1),
            "marginal_docs_per_s": [round(m, 1) for m in marginal],
            "marginal_spread": round(max(marginal) / min(marginal) - 1, 3) if marginal else None}


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    xs = [p["mb"] for p in points]
    for keys, label, name in ((("docs_per_s", "stage_docs_per_s"), "docs/s", "real_pipeline_docs_per_s.png"),
                              (("peak_rss_mb", "peak_pss_mb"), "peak memory of the process tree (MB)",
                               "real_pipeline_peak_rss.png")):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for key in keys:
            if any(key not in p for p in points):  # points from before PSS was sampled
                continue
            ax.plot(xs, [p[key] for p in points], "o-", label={"docs_per_s": "whole command",
                                                              "stage_docs_per_s": "data stages", "peak_rss_mb": "RSS",
                                                              "peak_pss_mb": "PSS (shared pages once)"}.get(key))
        if len(keys) > 1:
            ax.legend()
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.set_xlabel("corpus size (MB of text)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)


def plot_memory(series: dict[str, list[dict]], out: Path) -> None:
    """`out/real_pipeline_memory.png`: peak PSS of the tree by corpus size, one line per series (label -> scaling
    points), and beside it each phase's peak for the last series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    for label, points in series.items():
        a.plot([p["mb"] for p in points], [p["peak_pss_mb"] for p in points], "o-", label=label)
    last = list(series.values())[-1]
    for phase in ("collect", "filter", "dedup", "scrub"):  # a phase shorter than the 0.5 s PSS sampling has no point
        got = [(p["mb"], p["memory_by_stage"][phase]["peak_mb"]) for p in last if phase in p["memory_by_stage"]]
        b.plot([x for x, _ in got], [y for _, y in got], "o-", label=phase)
    for ax, title in ((a, "peak PSS of the run (MB)"), (b, f"peak PSS per stage: {list(series)[-1]}")):
        ax.set_xscale("log")
        ax.minorticks_off()
        xs = sorted({p["mb"] for pts in series.values() for p in pts})
        ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
        ax.set_xlabel("corpus size (MB of text)")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "real_pipeline_memory.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.real_pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=24, help="corpus size in MB of text (default 24)")
    ap.add_argument("--workers", type=int, default=2, help="workers on both sides (default 2)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for ours (`lifecycle run --set`), e.g. collect.max_part_bytes=8388608")
    ap.add_argument("--reps", type=int, default=2, help=(
        "alternating repetitions per side (default 2); 0 runs only the in-process per-stage profile"))
    ap.add_argument("--cache", type=Path, default=Path("/tmp/real-corpus"), help="where corpora are built and reused")
    ap.add_argument("--mix", choices=("crawl", "uniform"), help=(
        "bench/real_corpus.py's mix: default crawl against datatrove, uniform with --scaling (the same mix at every "
        "size)"))
    ap.add_argument("--recurring", action="store_true", help=(
        "ours as a recurring run: every repetition in one work dir whose embedded Prefect server and warm runner a "
        "first, untimed run started (its datasets removed before each, so every stage runs; the runner's memory "
        "counted); default: a new work dir each"))
    ap.add_argument("--up", action="store_true", help=(
        "ours against `lifecycle up` (Prefect and MLflow servers and the warm runner, started untimed): every "
        "repetition a `lifecycle run` in that work dir, after one untimed run; the runner's memory is counted"))
    ap.add_argument("--no-profile", action="store_true", help="skip the in-process per-stage profile")
    ap.add_argument("--scaling", help="comma-separated sizes in MB: ours alone, docs/s and peak memory per size")
    ap.add_argument("--plots", type=Path, help="with --scaling: folder for the PNG plots (e.g. docs/img)")
    args = ap.parse_args(argv)
    scaling(args) if args.scaling else compare(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
