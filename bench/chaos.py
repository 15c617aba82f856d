"""Chaos rounds: random faults during short `lifecycle run`s, each judged against an undisturbed run.

`python -m bench.chaos [ROUNDS] [--seed S] [--faults a,b,...] [--keep DIR]` (default 50 rounds, all faults).

First two undisturbed runs of the chaos config (the demo config, shortened by `OVERRIDES`) give the reference
outputs and show which outputs are deterministic at all: a stage's dataset sha256 and row counts, the final
checkpoint's `model.safetensors` sha256, and every summary metric the two runs agree on (a metric they disagree on,
such as a throughput, is left out and listed). Then each round starts a fresh `lifecycle run --json` in its own
work dir and injects one fault at a uniformly random moment of it:

- `flow_sigkill`: SIGKILL of `lifecycle run` itself.        - `flow_sigterm`: SIGTERM of it (must end in 30 s).
- `rank_sigkill`: SIGKILL of one training rank.             - `rank_sigstop`: SIGSTOP of one training rank.
- `disk_full`: the work dir's file system (a tmpfs of its own; needs root) is filled to the last byte.
- `byte_flip`: one byte flipped in a committed file (a dataset part or a checkpoint file, chosen at random).
- `tracking_dead`: the run logs to an `mlflow server`, which is SIGKILLed.
- `hostile_base_model`, `sandbox_abuse`, `server_killed` (a server's main process SIGKILLed under `lifecycle up`):
  see bench/chaos_faults.py.

A round passes when it ends within its bound in one of two ways: the run completes with outputs identical to the
reference, or it fails with a clear message (a final `lifecycle:` line, no traceback; a SIGKILLed flow has none
to give) and a rerun with the fault removed (disk space freed, tracking server restarted) completes with
identical outputs. After a byte flip the work dir is rerun and `lifecycle verify`ed even when the run completed,
since the flip may have hit a file the run had already read. No process of the round may outlive it (checked
10 s after its end, and after `lifecycle down` has stopped the work dir's embedded Prefect server, which outlives
runs by design: any process whose working directory is inside the round's directory).

`--warm`: each round first runs a short collect (one other document) in its work dir and waits for the warm runner
that run leaves beside the embedded server; the faulted run is then forked by that runner, as every run after the
first in a work dir is by default, and the round fails if it was not. Reruns follow `lifecycle down` and are cold.

`--spares N`: every run (the references too) trains with `train.launch.spares=N` and 120 steps instead of 30, so
that the standby world is up for most of training; each round records how many standby worlds its run promoted
(`promotions`), and a rank fault taken over in place completes in the same attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifecycle.core.fs import sha256_file  # noqa: E402
from lifecycle.core.procs import free_port  # noqa: E402
from lifecycle.flows.startup.servers import commands  # noqa: E402
from bench.chaos_faults import (STATIC, UpServers, hostile_base_model, sandbox_leftovers,  # noqa: E402
                                sandbox_problems, sandbox_problems_check)
CONFIG = ROOT / "deploy" / "configs" / "demo.yaml"
OVERRIDES = [f'collect.inputs=["{ROOT}/corpus/python-docs/*.jsonl.gz"]', "train.max_steps=30", "train.checkpoint.every=10", "train.optimizer.warmup_steps=5",
             "evaluate.max_batches=10"]
FAULTS = ("flow_sigkill", "flow_sigterm", "rank_sigkill", "rank_sigstop", "disk_full", "byte_flip", "tracking_dead",
          "hostile_base_model", "sandbox_abuse", "server_killed")
NOT_COMPARED = {"sandbox_abuse": ("dataset:evaluate",)}  # outputs a fault's own config changes
TMPFS_SIZE = "2g"
MESSAGE = re.compile(r"lifecycle( run)?: (?!warning: )")  # the run's own error line, e.g. `lifecycle run: run failed: ...`, not a warning
PACKAGE_CONTENT = ("model.safetensors", "model_config.json", "tokenizer.json")


def lifecycle_bin() -> str:
    return str(Path(sys.executable).with_name("lifecycle"))


# ------------------------------------------------------------------------------------------- one run

class Run:
    """One `lifecycle run --json` in `workdir`, started with its cwd in the round directory."""

    def __init__(self, round_dir: Path, workdir: Path, extra: list[str], until: str | None = None):
        self.round_dir, self.workdir = round_dir, workdir
        argv = [lifecycle_bin(), "run", str(CONFIG), "--json", "--set", f"workdir={workdir}",
                *(["--until", until] if until else [])]
        for kv in OVERRIDES + extra:
            argv += ["--set", kv]
        self.out = open(round_dir / f"run-{time.monotonic_ns()}.out", "w+")
        self.err = open(Path(self.out.name).with_suffix(".err"), "w+")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=round_dir, stdout=self.out, stderr=self.err,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "DS_ACCELERATOR": "cpu"})

    def wait(self, bound: float) -> tuple[int | None, float]:
        """(exit code or None if it outlived `bound`, seconds it took)."""
        try:
            rc = self.proc.wait(timeout=max(0.0, bound - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - self.t0

    def summary(self) -> dict | None:
        self.out.seek(0)
        lines = [line for line in self.out.read().splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    def last_error_line(self) -> str:
        """The run's own last `lifecycle:` line on stderr ('' if it printed none)."""
        self.err.seek(0)
        lines = [line.strip() for line in self.err.read().splitlines() if MESSAGE.match(line)]
        return lines[-1] if lines else ""

    def traceback(self) -> bool:
        self.err.seek(0)
        return "Traceback (most recent call last)" in self.err.read()


def outputs(summary: dict | None) -> dict:
    """What a completed run produced that an identical run must reproduce."""
    if not summary or summary.get("status") != "completed":
        return {}
    out = {}
    for stage, manifest in sorted(summary.get("datasets", {}).items()):
        m = json.loads(Path(manifest).read_text())
        if stage == "checkpoint":  # the packaged model: its lineage records work-dir paths and times; the content
            out["dataset:checkpoint"] = [sha256_file(Path(manifest).parent / name) for name in PACKAGE_CONTENT]
        else:
            out[f"dataset:{stage}"] = (m["sha256"], m["num_rows"], m.get("num_rejected"))
    if summary.get("checkpoint"):
        out["weights"] = sha256_file(Path(summary["checkpoint"]) / "model.safetensors")
    for k, v in sorted(summary.get("metrics", {}).items()):
        out[f"metric:{k}"] = v
    return json.loads(json.dumps(out))  # as reference.json holds them (tuples become lists)


def compare(got: dict, ref: dict) -> list[str]:
    return [k for k in ref if got.get(k) != ref[k]]


# ------------------------------------------------------------------------------------------- processes

def procs_under(directory: Path) -> list[int]:
    """Live processes whose working directory lies inside `directory`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if cwd == str(directory) or cwd.startswith(f"{directory}/"):
            found.append(int(d.name))
    return found


def ranks_of(workdir: Path) -> list[int]:
    """Training ranks of a run in `workdir` (their cwd is the train run directory)."""
    out = []
    for pid in procs_under(workdir / "train"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"lifecycle.tasks.train.trainer" in cmd and b"deepspeed.launcher" not in cmd and b"bin/deepspeed" not in cmd:
            out.append(pid)
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------- faults

def committed_files(workdir: Path) -> list[Path]:
    files = []
    for manifest in workdir.glob("datasets/*/*/_manifest.json"):
        try:
            m = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        files += [manifest.parent / f["path"] for f in m.get("files", []) + m.get("rejected", [])
                  if isinstance(f, dict) and "path" in f]
    for marker in workdir.glob("train/*/checkpoints/step_*/COMMITTED.json"):
        try:
            m = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        listed = m.get("files", [])  # a list of {path, bytes, sha256} (older markers: a {name: sha256} mapping)
        files += [marker.parent / (f["path"] if isinstance(f, dict) else f) for f in listed]
    return [f for f in files if f.is_file() and f.stat().st_size > 0]


def flip_byte(path: Path, rng: random.Random) -> str:
    st = path.stat()
    offset = rng.randrange(st.st_size)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot keeps the mtime
    return f"{path.relative_to(path.parents[2])}@{offset}"


def fill_disk(workdir: Path) -> Path:
    filler = workdir.parent / "filler"
    free = os.statvfs(workdir).f_bavail * os.statvfs(workdir).f_frsize
    with open(filler, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, free)
        except OSError:
            pass
        chunk = b"\0" * (1 << 20)
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    return filler


class TrackingServer:
    def __init__(self, round_dir: Path, port: int):
        self.round_dir, self.port, self.proc = round_dir, port, None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        store = self.round_dir / "tracking"
        store.mkdir(exist_ok=True)
        argv, env, _ = commands(store, 0, self.port, runner=False)["mlflow"]  # `lifecycle up`'s, on its own store
        self.proc = subprocess.Popen(argv, cwd=store, env={**os.environ, **env}, stdout=open(store / "server.log", "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        import urllib.request
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow server on {self.uri} did not start; see {store / 'server.log'}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# ------------------------------------------------------------------------------------------- rounds

def inject(fault: str, run: Run, rng: random.Random, t_ref: float, train_window: tuple[float, float],
           server: TrackingServer | None, ups: UpServers | None = None) -> str:
    """Wait for the fault's moment and inject it; returns what was done ('' if the run ended first)."""
    if fault in ("rank_sigkill", "rank_sigstop"):  # a uniform moment of training, counted from the first rank
        while not ranks_of(run.workdir):
            if run.proc.poll() is not None:
                return ""
            time.sleep(0.05)
        at = time.monotonic() - run.t0 + rng.uniform(0, 0.9 * (train_window[1] - train_window[0]))
    elif fault == "byte_flip":
        at = rng.uniform(0.1 * t_ref, t_ref)
    else:
        at = rng.uniform(0.05 * t_ref, 0.95 * t_ref)
    while time.monotonic() - run.t0 < at:
        if run.proc.poll() is not None:
            return ""
        time.sleep(0.05)
    when = f"at {time.monotonic() - run.t0:.1f}s"
    if fault == "flow_sigkill":
        os.kill(run.proc.pid, signal.SIGKILL)
        return f"SIGKILL flow {when}"
    if fault == "flow_sigterm":
        os.kill(run.proc.pid, signal.SIGTERM)
        return f"SIGTERM flow {when}"
    if fault in ("rank_sigkill", "rank_sigstop"):
        ranks = ranks_of(run.workdir)
        if not ranks:
            return ""
        pid = rng.choice(ranks)
        os.kill(pid, signal.SIGKILL if fault == "rank_sigkill" else signal.SIGSTOP)
        return f"{'SIGKILL' if fault == 'rank_sigkill' else 'SIGSTOP'} rank pid {pid} {when}"
    if fault == "disk_full":
        filler = fill_disk(run.workdir)
        return f"disk filled {when} ({filler.stat().st_size >> 20} MiB)"
    if fault == "byte_flip":  # the moment may come before the first commit: flip the first committed file
        files = committed_files(run.workdir)
        while not files and run.proc.poll() is None:
            time.sleep(0.05)
            files = committed_files(run.workdir)
        files = files or committed_files(run.workdir)
        return f"flipped {flip_byte(rng.choice(files), rng)} {when}" if files else ""
    if fault == "tracking_dead":
        server.kill()
        return f"tracking server killed {when}"
    if fault == "server_killed":
        done = ups.kill_main(rng)
        return f"{done} {when}" if done else ""
    raise ValueError(fault)


def warm_up(round_dir: Path, workdir: Path, extra: list[str], bound: float) -> str:
    """`--warm`: a first run in the round's work dir (collect of one other document, so the faulted run still
    computes everything), then its embedded runner given time to answer: the faulted run is then a warm one, forked
    by the runner (lifecycle/launch.py), as every run after the first in a work dir is by default."""
    from lifecycle.flows.startup.embedded_runner import wait_embedded_runner

    doc = round_dir / "warm-up.jsonl"
    doc.write_text(json.dumps({"id": "warm-up", "text": "A warm-up document for the runner. " * 20}) + "\n")
    run = Run(round_dir, workdir, extra + [f'collect.inputs=["{doc}"]'], until="collect")
    rc, _ = run.wait(bound)
    if rc != 0:
        raise RuntimeError(f"the warm-up run failed ({rc}): {run.last_error_line()} (see {run.err.name})")
    if wait_embedded_runner(workdir, timeout=120) is None:
        raise RuntimeError(f"no embedded runner answered after the warm-up run in {workdir}")
    return str(workdir / ".servers" / "embedded-runner.log")


def promotions(workdir: Path) -> int:
    """Standby worlds promoted in the work dir's training runs (`train.launch.spares`)."""
    return sum(len(p.read_text().splitlines()) for p in workdir.glob("train/*/promotions.jsonl"))


def one_round(i: int, fault: str, base: Path, rng: random.Random, ref: dict, t_ref: float,
              train_window: tuple[float, float], bound: float, warm: bool = False) -> dict:
    round_dir = base / f"round{i:03d}"
    round_dir.mkdir()
    mounted = False
    if fault == "disk_full":
        (round_dir / "fs").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(round_dir / "fs")], check=True)
        mounted = True
        workdir = round_dir / "fs" / "work"
    else:
        workdir = round_dir / "work"
    server, extra = None, []
    if fault == "tracking_dead":
        server = TrackingServer(round_dir, free_port())
        server.start()
        extra = [f"tracking.tracking_uri={server.uri}"]
    rec = {"round": i, "fault": fault, "outcome": "FAIL", "problems": []}
    ups, faulty, sandbox_before = None, [], sandbox_leftovers() if fault == "sandbox_abuse" else None
    try:
        runner_log = warm_up(round_dir, workdir, extra, bound) if warm else None
        if fault == "hostile_base_model":
            faulty, rec["injected"] = hostile_base_model(round_dir, rng)
        elif fault == "sandbox_abuse":
            faulty, rec["injected"] = sandbox_problems(round_dir, workdir)
        elif fault == "server_killed":
            ups = UpServers(round_dir, workdir)
            ups.up()
        run = Run(round_dir, workdir, extra + faulty)
        if fault not in STATIC:
            rec["injected"] = inject(fault, run, rng, t_ref, train_window, server, ups)
        rc, secs = run.wait(bound)
        rec.update(rc=rc, seconds=round(secs, 1), promotions=promotions(workdir))
        if runner_log:  # the runner logs each run it forks: the faulted run must be one
            forked = [l for l in Path(runner_log).read_text().splitlines() if l.startswith("runner: run ")]
            rec["warm"] = len(forked) == 1
            if not rec["warm"]:
                rec["problems"].append(f"--warm: the faulted run was not forked by the runner ({runner_log})")
        if rc is None:
            rec["problems"].append(f"run still going after {bound:.0f}s (hang)")
            signal_all([run.proc.pid] + procs_under(round_dir), signal.SIGKILL)
            run.proc.wait()
        if fault == "flow_sigterm" and rec["injected"] and rc is not None:
            t_signal = float(rec["injected"].rsplit("at ", 1)[1].rstrip("s"))
            if secs - t_signal > 30:
                rec["problems"].append(f"SIGTERM took {secs - t_signal:.0f}s to end the run (bound 30s)")
        rec["leftover"] = leftovers(round_dir, workdir)
        if rec["leftover"]:
            rec["problems"].append(f"processes outlived the run: {rec['leftover']}")
        if rc == 0:
            diff = [k for k in compare(outputs(run.summary()), ref) if not k.startswith(NOT_COMPARED.get(fault, ()))]
            if diff:
                rec["problems"].append(f"completed with different outputs: {diff}")
            rec["ended"] = "completed"
        elif rc is not None:
            rec["ended"] = "failed"
            rec["message"] = run.last_error_line()
            if fault != "flow_sigkill" and (run.traceback() or not rec["message"]):
                rec["problems"].append(f"unclear failure message: {rec['message']!r}")
        if sandbox_before is not None:
            rec["problems"] += sandbox_problems_check(sandbox_before, run.summary())
        # the fault is over: free the disk, restart the server, rerun where needed
        (workdir.parent / "filler").unlink(missing_ok=True)
        if server:
            server.start()
        if ups and rc != 0:
            ups.up()  # `leftovers` ran `lifecycle down`
        if rc != 0 or fault == "byte_flip":
            rerun = Run(round_dir, workdir, extra)
            rrc, rsecs = rerun.wait(bound)
            rec.update(rerun_rc=rrc, rerun_seconds=round(rsecs, 1))
            if rrc != 0:
                rec["problems"].append(f"rerun exit {rrc}: {rerun.last_error_line()!r}")
                signal_all([rerun.proc.pid] + procs_under(round_dir), signal.SIGKILL)
            else:
                diff = compare(outputs(rerun.summary()), ref)
                if diff:
                    rec["problems"].append(f"rerun completed with different outputs: {diff}")
            if fault == "byte_flip" and rrc == 0:
                v = subprocess.run([lifecycle_bin(), "verify", "--workdir", str(workdir)], capture_output=True,
                                   text=True, cwd=round_dir, timeout=bound)
                if v.returncode != 0:
                    rec["problems"].append(f"lifecycle verify after the rerun: exit {v.returncode}")
        rec["outcome"] = "pass" if not rec["problems"] else "FAIL"
    finally:
        subprocess.run([lifecycle_bin(), "down", "--workdir", str(workdir)], capture_output=True, timeout=60)
        if server:
            server.kill()
        if mounted:
            signal_all(procs_under(round_dir), signal.SIGKILL)
            time.sleep(0.5)
            subprocess.run(["umount", "-l", str(round_dir / "fs")], check=False)
    return rec


def leftovers(round_dir: Path, workdir: Path) -> list[str]:
    """Processes still inside the round 10 s after its run ended (stopped ranks are resumed so they can die). The
    work dir's embedded Prefect server outlives a run by design (the next run reuses it): it is stopped first, the
    way a user stops it (`lifecycle down`), and a server that will not stop counts as a leftover."""
    subprocess.run([lifecycle_bin(), "down", "--workdir", str(workdir)], capture_output=True, timeout=60)
    time.sleep(10)
    pids = procs_under(round_dir)
    names = []
    for pid in pids:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            names.append(f"{pid}:{argv0[-40:]}")
        except OSError:
            pass
    signal_all(pids, signal.SIGCONT)
    signal_all(pids, signal.SIGKILL)
    return names


def reference(base: Path) -> tuple[dict, float, tuple[float, float], list[str]]:
    """Two undisturbed runs: the reference outputs, the run time, the training window, and the unstable keys."""
    results = []
    for name in ("ref1", "ref2"):
        d = base / name
        d.mkdir()
        run = Run(d, d / "work", [])
        first_rank = last_rank = None
        while run.proc.poll() is None:
            if ranks_of(d / "work"):
                last_rank = time.monotonic() - run.t0
                first_rank = first_rank if first_rank is not None else last_rank
            time.sleep(0.1)
        secs = time.monotonic() - run.t0
        s = run.summary()
        subprocess.run([lifecycle_bin(), "down", "--workdir", str(d / "work")], capture_output=True, timeout=60)
        if run.proc.returncode != 0 or not s or first_rank is None:
            raise RuntimeError(f"undisturbed run failed: {run.last_error_line()} (see {run.err.name})")
        results.append((outputs(s), secs, (first_rank, last_rank)))
    (a, t1, w1), (b, t2, _) = results
    unstable = sorted(k for k in a if a[k] != b.get(k))
    if any(not k.startswith("metric:") for k in unstable):
        raise RuntimeError(f"two undisturbed runs disagree on {unstable}: outputs are not deterministic")
    ref = {k: v for k, v in a.items() if k not in unstable}
    return ref, max(t1, t2), w1, unstable


def main(rounds: int = 50, seed: int = 0, faults: tuple[str, ...] = FAULTS, keep: str | None = None,
         warm: bool = False, spares: int = 0) -> dict:
    rng = random.Random(seed)
    if spares:
        OVERRIDES[OVERRIDES.index("train.max_steps=30")] = "train.max_steps=120"
        OVERRIDES.append(f"train.launch.spares={spares}")
    if "disk_full" in faults and os.geteuid() != 0:
        print("disk_full needs root (a tmpfs per round); left out")
        faults = tuple(f for f in faults if f != "disk_full")
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    saved = base / "reference.json"  # a kept directory's reference runs are reused by the next invocation
    if saved.exists():
        ref, t_ref, window, unstable = json.loads(saved.read_text())
    else:
        ref, t_ref, window, unstable = reference(base)
        saved.write_text(json.dumps([ref, t_ref, window, unstable]))
    bound = max(3 * t_ref, t_ref + 180)
    print(f"reference: {t_ref:.0f}s per run, training {window[0]:.0f}-{window[1]:.0f}s, {len(ref)} outputs compared"
          f"{'; left out as unstable between undisturbed runs: ' + ', '.join(unstable) if unstable else ''}; "
          f"bound per run {bound:.0f}s", flush=True)
    mix = [faults[i % len(faults)] for i in range(rounds)]
    rng.shuffle(mix)
    records, missed, i = [], 0, 0
    while len(records) < rounds and missed <= rounds:
        i += 1
        fault = mix[len(records)]
        rec = one_round(i, fault, base, rng, ref, t_ref, window, bound, warm)
        if not rec.get("injected") and not rec["problems"]:  # the run ended before the fault's moment: the
            missed += 1  # machine is faster than during the reference runs; draw again from this run's time
            t_ref = min(t_ref, rec["seconds"])
            print(f"round {i:2d} {fault:<13} missed: the run ended after {rec['seconds']}s, before the fault; redrawn")
            continue
        records.append(rec)
        print(f"round {i:2d} {fault:<13} {rec['outcome']:<4} {'(warm) ' if rec.get('warm') else ''}"
              f"{'(standby promoted) ' if rec.get('promotions') else ''}"
              f"{rec.get('injected') or 'run ended before the fault'}; "
              f"{rec.get('ended', 'hung')} in {rec.get('seconds')}s"
              + (f", rerun {rec.get('rerun_rc')} in {rec.get('rerun_seconds')}s" if "rerun_rc" in rec else "")
              + (f"; message: {rec['message']}" if rec.get("message") else "")
              + (f"; PROBLEMS: {rec['problems']}" if rec["problems"] else ""), flush=True)
        with open(base / "rounds.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
    rounds = len(records)
    passed = sum(r["outcome"] == "pass" for r in records)
    by_fault = {f: f"{sum(r['outcome'] == 'pass' for r in records if r['fault'] == f)}/{mix.count(f)}" for f in faults}
    longest = max((r.get("seconds") or 0) + (r.get("rerun_seconds") or 0) for r in records) if records else 0
    print(f"{passed}/{rounds} rounds passed ({', '.join(f'{k} {v}' for k, v in by_fault.items())}); "
          f"{missed} missed and redrawn; "
          f"{sum(1 for r in records if r.get('promotions'))} round(s) recovered by a standby world; longest round {longest:.0f}s (bound {bound:.0f}s per run); {time.monotonic() - t_start:.0f}s in all; "
          f"records: {base / 'rounds.jsonl'}")
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    return {"rounds": rounds, "passed": passed, "by_fault": by_fault,
            "promoted": sum(1 for r in records if r.get("promotions"))}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int, nargs="?", default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    ap.add_argument("--keep", help="keep every round's work dir and logs here")
    ap.add_argument("--warm", action="store_true", help=(
        "fault warm runs: each round first runs a short collect in its work dir and waits for the embedded "
        "server's warm runner, so the faulted run is forked by it (the default path of every run after the first)"))
    ap.add_argument("--spares", type=int, default=0, help=(
        "train with train.launch.spares=N (and 120 steps, so the standby is up for most of training)"))
    a = ap.parse_args()
    bad = set(a.faults.split(",")) - set(FAULTS)
    if bad:
        ap.error(f"unknown fault(s) {sorted(bad)}; choose from {','.join(FAULTS)}")
    sys.exit(0 if main(a.rounds, a.seed, tuple(a.faults.split(",")), a.keep, a.warm, a.spares)["passed"] == a.rounds else 1)
