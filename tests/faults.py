"""SIGKILL a training run (the `run_train` supervisor and its ranks at once) at random
moments, resume it, and compare each resumed run's loss curve and final weights with an uninterrupted run's.

Used by tests/train/test_faults.py (slow-marked) and by `python -m bench.kill_resume`, which reports the counts.
Every third trial waits for a checkpoint being written (a tag directory without its commit marker) and kills
inside the save; the others kill after a uniform random delay into training. The rerun is the same `run_train`
call, which resumes from the last committed checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, json
sys.path.insert(0, {root!r})
from tests.faults import config, tokens
from lifecycle.tasks.train.launch import run_train
r = run_train(tokens({tokdir!r}), config(**{opts!r}), {workdir!r})
print(json.dumps({{"checkpoint": r.checkpoint_dir, "metrics": r.metrics_path, "resumed_from": r.resumed_from}}))
"""


def config(accelerator: str = "cpu", ranks: int = 2, precision: str = "fp32", checkpoint: dict | None = None,
           model: dict | None = None, batch: dict | None = None, max_steps: int = 40, init_from: str = "scratch",
           parallel: dict | None = None, zero_stage: int = 2, moe: dict | None = None, compile: bool | str = "auto",
           launch: dict | None = None):
    """The faults' training run; `checkpoint`, `model`, `batch` and `parallel` override fields of those sections;
    `init_from: hf:<dir>` continues that checkpoint (its config.json gives the architecture); `moe`: the
    `train.moe` section (mixture of experts); `launch`: fields of `train.launch`."""
    from lifecycle.tasks.train.config import ModelConfig, TrainConfig

    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64, "seq_len": 64, "dropout": 0.1, **(model or {})}
    arch = ModelConfig(**shape) if init_from == "scratch" else {"seq_len": shape["seq_len"], "dropout": shape["dropout"]}
    return TrainConfig(model=arch, init_from=init_from, max_steps=max_steps,
                       optimizer={"decay_steps": max(60, max_steps), "warmup_steps": 5, "lr": 3e-3, "min_lr": 3e-4},
                       batch={"micro_batch_size": 8, "num_ranks": ranks, **(batch or {})},
                       engine={"zero_stage": zero_stage, "precision": precision, "accelerator": accelerator,
                               "compile": compile},
                       checkpoint={"every": 5, "keep_last": 2, **(checkpoint or {})}, logging={"every": 1},
                       parallel=parallel or {},
                       launch={"threads_per_rank": 1, "timeout_s": 600, **(launch or {})}, moe=moe or {})


def tokens(tokdir: str):
    from tests.train.test_train import make_tokens  # the tiny learnable corpus of tests/train/test_train.py

    return make_tokens(tokdir, 600)


def launch(tokdir: str, workdir: str, opts: dict) -> subprocess.Popen:
    code = CHILD.format(root=str(ROOT), tokdir=tokdir, workdir=workdir, opts=opts)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "DS_ACCELERATOR": opts["accelerator"]})


def descendants_of_supervisor(pid: int) -> list[int]:
    """Processes started by run_train in supervisor `pid`: the ranks (and a hostfile launch's launcher) carry its
    pid in their env."""
    mark = f"LIFECYCLE_SUPERVISOR_PID={pid}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def rank_pids(supervisor: int, world: str = "") -> dict[int, int]:
    """{rank: pid} of the training ranks under run_train in process `supervisor` (not the launcher, not the
    ranks' persist processes: the process that runs the trainer module) of world `world` ("": the launch's
    first; "spare<k>": a standby world of `train.launch.spares`)."""
    out = {}
    for pid in descendants_of_supervisor(supervisor):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        in_world = next((e[16:].decode() for e in env if e.startswith(b"LIFECYCLE_WORLD=")), "")
        if b"-m" in cmd and b"lifecycle.tasks.train.trainer" in cmd and in_world == world:
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = pid
    return out


def records(workdir: str, kind: str) -> list[dict]:
    """The run's metrics.jsonl records of `kind` (complete lines only)."""
    paths = list(Path(workdir).glob("train/*/metrics.jsonl"))
    if not paths:
        return []
    lines = paths[0].read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.endswith("}")) if r["kind"] == kind]


def evict_from_page_cache(root: Path) -> int:
    """Drop the cached pages of every file under `root` (POSIX_FADV_DONTNEED; written and fsynced, so clean):
    the next read comes from the device, as after a node replacement or from storage this node never cached.
    Returns the bytes whose pages were dropped."""
    total = 0
    for f in (p for p in root.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def kill_rank_and_relaunch(tokdir: str, workdir: str, opts: dict, after_step: int, rank: int = 1,
                           finish: bool = True, timeout: float = 900, evict: bool = False) -> dict:
    """A rank failure and its retry: run until a commit at or after `after_step` (and, with the memory tier,
    its tier commit), SIGKILL rank `rank` alone, let run_train fail as it does when a rank dies, then call it
    again (what Prefect's retry does) and time the relaunch: Popen to the first training step recorded.
    `finish`: let the relaunched run finish (else it is killed after its first step). `evict`: before the
    relaunch, drop the run's checkpoint files from the page cache (`evict_from_page_cache`).
    Returns {"killed_after", "failed_rc", "relaunch_to_first_step", "first_step_time" (that step's own
    step_time), "restore" (the restore record), "rc"}."""

    proc = launch(tokdir, workdir, opts)
    run_dir = ready_run_dir(proc, workdir)
    killed_after = wait_commit(proc, run_dir, opts, after_step, timeout)
    os.kill(rank_pids(proc.pid)[rank], signal.SIGKILL)
    proc.communicate(timeout=timeout)  # run_train fails: the launcher saw a rank die
    evicted = evict_from_page_cache(run_dir / "checkpoints") if evict else 0
    t0 = time.time()
    again = launch(tokdir, workdir, opts)
    t_first, first_step_time = first_step_after_restore(again, workdir, timeout)
    end(again, finish, timeout)
    restored = records(workdir, "restore")
    return {"killed_after": killed_after, "failed_rc": proc.returncode,
            "relaunch_to_first_step": t_first - t0 if t_first else None, "first_step_time": first_step_time,
            "restore": restored[-1] if restored else None, "rc": again.returncode, "evicted_bytes": evicted}


def ready_run_dir(proc: subprocess.Popen, workdir: str) -> Path:
    log = wait_ready(proc, workdir)
    if log is None:
        raise RuntimeError(f"the run in {workdir} ended before its ranks were ready")
    return log.parent


def wait_commit(proc: subprocess.Popen, run_dir: Path, opts: dict, after_step: int, timeout: float,
                also: Callable[[], bool] = lambda: True, what: str = "") -> int:
    """The step of the first commit at or after `after_step` (with the memory tier, once the tier holds it too)
    seen while `also()` holds."""
    from lifecycle.tasks.train import commit as ckpt
    from lifecycle.tasks.train import memtier

    deadline = time.monotonic() + timeout
    tier_on = opts.get("checkpoint", {}).get("memory_tier", True)
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run in {run_dir} ended (or timed out) before a commit at step {after_step}{what}")
        done = [s for s, _ in ckpt.list_committed(run_dir / "checkpoints")]
        tier_step = memtier.committed_step(memtier.path_for(run_dir))
        if done and done[-1] >= after_step and (not tier_on or tier_step == done[-1]) and also():
            return done[-1]
        time.sleep(0.01)


def first_step_after_restore(proc: subprocess.Popen, workdir: str, timeout: float,
                             restores_before: int = 0) -> tuple[float | None, float | None]:
    """(wall time it was seen, its step_time) of the first training step recorded after a restore record newer
    than the first `restores_before`; (None, None) if the process ends or `timeout` passes first."""
    start = time.time()
    while proc.poll() is None and time.time() < start + timeout:
        restored = records(workdir, "restore")
        if len(restored) > restores_before and (
                steps := [r for r in records(workdir, "train") if r["step"] > restored[-1]["step"]]):
            return time.time(), steps[0].get("step_time")
        time.sleep(0.01)
    return None, None


def end(proc: subprocess.Popen, finish: bool, timeout: float) -> None:
    """Let the run finish, or kill it with everything it started."""
    if finish:
        proc.communicate(timeout=timeout)
    else:
        kill_all(proc)


def kill_rank_with_spare(tokdir: str, workdir: str, opts: dict, after_step: int, rank: int = 1,
                         finish: bool = True, timeout: float = 900, evict: bool = False) -> dict:
    """A rank failure under `train.launch.spares`: run until a commit at or after `after_step` (and its tier
    commit, with the memory tier) with the standby world built and waiting, SIGKILL rank `rank` of the training
    world alone, and time the takeover inside the same run_train: from the kill (and from the supervisor's
    promotion) to the first training step the promoted world records. `evict`: drop the checkpoint's files from
    the page cache just before the kill. Returns {"killed_after", "kill_to_first_step",
    "promotion_to_first_step", "first_step_time", "restore", "promotions" (promotions.jsonl), "rc"}."""
    from lifecycle.tasks.train.supervise import standby_ready

    proc = launch(tokdir, workdir, opts)
    run_dir, ranks = ready_run_dir(proc, workdir), opts.get("ranks", 2)
    ready = lambda: standby_ready(run_dir, ranks, "spare1")  # noqa: E731
    killed_after = wait_commit(proc, run_dir, opts, after_step, timeout, also=ready, what=" with its standby ready")
    evicted = evict_from_page_cache(run_dir / "checkpoints") if evict else 0
    restores_before = len(records(workdir, "restore"))
    pids = rank_pids(proc.pid)
    t_kill = time.time()
    os.kill(pids[rank], signal.SIGKILL)
    t_first, first_step_time = first_step_after_restore(proc, workdir, timeout, restores_before)
    end(proc, finish, timeout)
    promotions = [json.loads(line) for line in open(run_dir / "promotions.jsonl")] \
        if (run_dir / "promotions.jsonl").exists() else []
    restored = records(workdir, "restore")
    return {"killed_after": killed_after, "kill_to_first_step": t_first - t_kill if t_first else None,
            "first_step_time": first_step_time,
            "promotion_to_first_step": t_first - promotions[0]["time"] if promotions and t_first else None,
            "kill_to_failure_seen": promotions[0]["failed_at"] - t_kill if promotions else None,
            "restore": restored[-1] if len(restored) > restores_before else None, "promotions": promotions,
            "rc": proc.returncode, "evicted_bytes": evicted}


def kill_all(proc: subprocess.Popen) -> None:
    for pid in descendants_of_supervisor(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def result(workdir: str) -> dict:
    run = next((Path(workdir) / "train").iterdir())
    losses = [(r["step"], r["loss"]) for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
    committed = sorted(run.glob("checkpoints/step_*/COMMITTED.json"))  # the last commit is the run's final one
    final = committed[-1].parent / "model.safetensors" if committed else run / "none"
    return {"losses": losses, "weights": final.read_bytes() if final.exists() else None}


def wait_ready(proc: subprocess.Popen, workdir: str) -> Path | None:
    """The run's train.log once the ranks report ready (training starts), or None if the process ended."""
    while proc.poll() is None:
        logs = list(Path(workdir).glob("train/*/train.log"))
        if logs and "ranks ready" in logs[0].read_text(errors="replace"):
            return logs[0]
        time.sleep(0.05)
    return None


def trial(tokdir: str, workdir: str, inside_save: bool, rng: random.Random, train_s: float, opts: dict) -> dict:
    proc = launch(tokdir, workdir, opts)
    log = wait_ready(proc, workdir)
    started = time.monotonic()
    delay = rng.uniform(0.0, train_s)  # a uniform moment of the reference run's training time
    target = rng.choice(range(5, 40, 5))  # the save to kill inside
    where = "ended before the kill"
    while proc.poll() is None:
        ck = log.parent / "checkpoints"
        if inside_save:
            tag = ck / f"step_{target:08d}"
            writing = [tag] if tag.exists() and not (tag / "COMMITTED.json").exists() else []
            if writing:
                kill_all(proc)
                where = f"inside the save of {writing[0].name}"
                break
        elif time.monotonic() - started >= delay:
            kill_all(proc)
            where = f"{delay:.2f}s into training"
            break
        time.sleep(0.002)
    final_committed = (log.parent / "checkpoints" / "step_00000040" / "COMMITTED.json").exists()
    if final_committed:
        where += " (after the final commit)"
    mpath = log.parent / "metrics.jsonl"
    lines = mpath.read_text().splitlines() if mpath.exists() else []
    killed_at = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    resumed = launch(tokdir, workdir, opts)
    out, _ = resumed.communicate()
    info = json.loads(out.strip().splitlines()[-1]) if resumed.returncode == 0 else {"error": resumed.returncode}
    return {"where": where, "mid_run": not where.startswith("ended") and not final_committed, "last_logged_step_before_kill": killed_at[-1] if killed_at else 0,
            "resumed_from": info.get("resumed_from"), **result(workdir)}


def kill_and_resume(kills: int = 10, seed: int = 0, accelerator: str = "cpu", ranks: int = 2,
                    precision: str = "fp32", init_from: str = "scratch", parallel: dict | None = None,
                    moe: dict | None = None, compile: bool | str = "auto") -> dict:
    """`kills` trials against one uninterrupted reference run; prints one line per trial and the totals.
    `compile`: train.engine.compile of every run (auto: on for cuda).
    Returns {"kills", "identical" (bitwise-identical resumes), "identical_mid_run" (those killed before the final
    commit, i.e. really resumed)}."""
    rng = random.Random(seed)
    opts = {"accelerator": accelerator, "ranks": ranks, "precision": precision, "init_from": init_from,
            **({"parallel": parallel} if parallel else {}), **({"moe": moe} if moe else {}),
            **({"compile": compile} if compile != "auto" else {})}
    with tempfile.TemporaryDirectory() as tmp:
        tokdir = str(Path(tmp) / "tokens")
        ref_proc = launch(tokdir, str(Path(tmp) / "ref"), opts)
        log = wait_ready(ref_proc, str(Path(tmp) / "ref"))
        t0 = time.monotonic()
        final = log.parent / "checkpoints" / "step_00000040" / "COMMITTED.json"
        while not final.exists() and ref_proc.poll() is None:
            time.sleep(0.01)
        train_s = time.monotonic() - t0  # ranks ready -> final commit: the window a kill should hit
        ref_proc.communicate()
        ref = result(str(Path(tmp) / "ref"))
        if ref["weights"] is None:
            raise RuntimeError(f"the uninterrupted reference run failed: see {log}")
        identical = mid = 0
        for i in range(kills):
            t = trial(tokdir, str(Path(tmp) / f"trial{i}"), inside_save=i % 3 == 2, rng=rng, train_s=train_s, opts=opts)
            same = t["losses"] == ref["losses"] and t["weights"] == ref["weights"]
            identical += same
            mid += t["mid_run"] and same
            print(f"kill {i + 1:2d}: {t['where']:<38} resumed from step {t['resumed_from']}, "
                  f"loss curve and final weights {'bitwise-identical' if same else 'DIFFERENT'}", flush=True)
    compiled = compile is True or (compile == "auto" and accelerator == "cuda")
    print(f"{accelerator}, {ranks} rank(s), {precision}{f', {parallel}' if parallel else ''}, "
          f"{'compiled' if compiled else 'eager'}: "
          f"{identical}/{kills} killed-and-resumed runs bitwise-identical to the uninterrupted run "
          f"({mid} of them killed before the final commit, i.e. really resumed)")
    return {"kills": kills, "identical": identical, "identical_mid_run": mid}
