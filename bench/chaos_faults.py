"""The chaos rounds' faults that are inputs or servers rather than a signal at a random moment (issue 44):

- `hostile_base_model`: the run continues a Hugging Face checkpoint (`train.init_from=hf:DIR`, a tiny Llama from
  bench.hf_import) made hostile one of three ways: a million layers, no `hidden_size`, or `generation_config.json`
  a symlink to /etc/shadow. It must fail at config build with one clear line; the rerun without it is the reference.
- `sandbox_abuse`: the evaluate stage also runs code evaluation (`evaluate.code`) on problems whose code attacks
  the sandbox: SysV shared memory left behind, a disk filled with fallocate, a user namespace, the work dir read,
  children left to die. Each problem passes only if its attack got through: the run must complete with
  `code_passed` 0 and every layer held, leave no SysV object and no `<defunct>` process of a sandbox uid, and its
  other outputs must be the reference's (the evaluate dataset differs by its config and is not compared).
- `server_killed`: the run talks to `lifecycle up`'s servers, and the main process of one of them (MLflow's or
  Prefect's, at random) is SIGKILLed at a random moment, as an OOM kill would. The run completes identically or
  fails clearly; `lifecycle down` must stop what is left of that server (the round's leftover check), and a rerun
  after `down` and `up` is the reference.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

SANDBOX_UID_BASE = 0x4000_0000  # tasks/eval/code/sandbox.py SandboxLimits.uid_base: every slot uid is above it
HOSTILE = ("a million layers", "no hidden_size", "generation_config.json -> /etc/shadow")
STATIC = ("hostile_base_model", "sandbox_abuse")  # faults that are inputs: injected as the run starts


def hostile_base_model(round_dir: Path, rng: random.Random) -> tuple[list[str], str]:
    """(config overrides, what was done): a tiny Llama checkpoint made hostile one of the `HOSTILE` ways."""
    from bench.hf_import import make_tiny

    d = make_tiny(round_dir / "base-model", "llama3")
    variant = rng.choice(HOSTILE)
    cfg = json.loads((d / "config.json").read_text())
    if variant == HOSTILE[0]:
        cfg["num_hidden_layers"] = 1_000_000
    elif variant == HOSTILE[1]:
        del cfg["hidden_size"]
    else:
        (d / "generation_config.json").unlink(missing_ok=True)
        (d / "generation_config.json").symlink_to("/etc/shadow")
    (d / "config.json").write_text(json.dumps(cfg))
    return [f"train.init_from=hf:{d}"], f"hostile base model: {variant}"


ATTACKS = {  # name -> code that sets ESCAPED (True only if the attack got through the sandbox)
    "sysv": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
             "for _ in range(4):\n    i = libc.shmget(0, 16 << 20, 0o1600)\n    a = libc.shmat(i, None, 0)\n"
             "    ctypes.memset(a, 1, 16 << 20)\n    libc.shmdt(ctypes.c_void_p(a))\nESCAPED = False\n"),
    "disk": ("import os\nESCAPED = True\ntry:\n    for n in range(200):\n"
             "        fd = os.open(f'f{n}', os.O_CREAT | os.O_WRONLY)\n        os.posix_fallocate(fd, 0, 16 << 20)\n"
             "        os.close(fd)\nexcept OSError:\n    ESCAPED = False\n"),
    "userns": ("import ctypes\nESCAPED = ctypes.CDLL(None).unshare(0x10000000) == 0\n"),
    "workdir": "import os\nESCAPED = os.path.exists(WORKDIR)\n",
    "zombies": ("import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        time.sleep(60)\n"
                "time.sleep(60)\nESCAPED = False\n"),
}


def sandbox_problems(round_dir: Path, workdir: Path) -> tuple[list[str], str]:
    """(config overrides, what was done): code evaluation of one problem per attack. The sampled completion lands
    inside a string literal, so whatever the model writes, the attack runs."""
    path = round_dir / "hostile-problems.jsonl"
    with open(path, "w") as f:
        for name, code in ATTACKS.items():
            prompt = code.replace("WORKDIR", repr(str(workdir))) + '_completion = r"""'  # raw: any backslash is text
            test = '"""\ndef check(candidate):\n    assert ESCAPED, "contained"\n'
            f.write(json.dumps({"task_id": name, "prompt": prompt, "test": test, "entry_point": "None"}) + "\n")
    extra = ["evaluate.code.enabled=true", f"evaluate.code.problems={path}", "evaluate.code.num_samples=1",
             "evaluate.code.k=[1]", "evaluate.code.max_new_tokens=8", "evaluate.code.workers=2"]
    return extra, f"sandbox abuse: {', '.join(ATTACKS)}"


def sandbox_leftovers() -> dict:
    """SysV objects and zombie processes owned by sandbox uids, on the host."""
    objects = []
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            rows = [line.split() for line in f]
        col = rows[0].index("uid")
        objects += [f"{kind} {r[1]}" for r in rows[1:] if int(r[col]) >= SANDBOX_UID_BASE]
    zombies = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid >= SANDBOX_UID_BASE and \
                    (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(int(d.name))
        except OSError:
            continue
    return {"sysv": objects, "zombies": zombies}


def sandbox_problems_check(before: dict, summary: dict | None) -> list[str]:
    """What the sandbox let through: attacks that passed, layers that did not hold, objects and zombies left."""
    problems = []
    after = sandbox_leftovers()
    for what in ("sysv", "zombies"):
        if new := sorted(set(after[what]) - set(before[what])):
            problems.append(f"sandbox left {what} on the host: {new}")
    metrics = (summary or {}).get("metrics", {})
    if summary and summary.get("status") == "completed":
        if metrics.get("code_passed") != 0:
            problems.append(f"{metrics.get('code_passed')} sandbox attack(s) got through (code_passed)")
        if metrics.get("code_sandbox_full") != 1:
            problems.append("a sandbox layer did not hold on this machine (code_sandbox_full != 1)")
    return problems


def lifecycle_bin() -> str:
    return str(Path(sys.executable).with_name("lifecycle"))


class UpServers:
    """`lifecycle up` for a round's work dir, on free ports; `kill_main` SIGKILLs one server's main process."""

    def __init__(self, round_dir: Path, workdir: Path):
        self.round_dir, self.workdir = round_dir, workdir

    def up(self) -> None:
        from lifecycle.core.procs import free_port

        argv = [lifecycle_bin(), "up", "--workdir", str(self.workdir), "--prefect-port", str(free_port()),
                "--mlflow-port", str(free_port())]
        done = subprocess.run(argv, cwd=self.round_dir, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"lifecycle up failed ({done.returncode}): {done.stderr.strip()[-500:]}")

    def down(self) -> None:
        subprocess.run([lifecycle_bin(), "down", "--workdir", str(self.workdir)], cwd=self.round_dir,
                       capture_output=True, timeout=120)

    def kill_main(self, rng: random.Random) -> str:
        state = json.loads((self.workdir / ".servers" / "servers.json").read_text())
        name = rng.choice(["mlflow", "prefect"])
        try:
            os.kill(state[name]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return ""
        time.sleep(0.2)
        return f"SIGKILL of {name}'s main process (pid {state[name]['pid']}) under `up`"
