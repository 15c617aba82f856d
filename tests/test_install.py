"""The install paths of issue 17, without the network: the two lock files agree, `make install` picks the lock of
the torch build it installs, the GPU machine scripts (bench/gpu_wheels.sh, bench/gpu_setup.sh) parse and answer
--help, and gpu_wheels.sh's train set covers what the training path imports."""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPTS = [ROOT / "bench" / "gpu_wheels.sh", ROOT / "bench" / "gpu_setup.sh"]
# a `make` run by `make test` exports its jobserver and level: the dry runs below are top-level makes
MAKE_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "CUDA")}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not name==version"
            out[norm(name)] = version.strip()
    return out


def test_cuda_lock_keeps_every_shared_pin():
    cpu, cuda = pins(ROOT / "constraints.txt"), pins(ROOT / "constraints-cuda.txt")
    differ = {n: (cpu[n], cuda[n]) for n in cpu.keys() & cuda.keys() if cpu[n] != cuda[n]}
    assert not differ, f"constraints-cuda.txt pins other versions than constraints.txt (make lock-cuda): {differ}"
    assert not cpu.keys() - cuda.keys(), f"missing from constraints-cuda.txt: {sorted(cpu.keys() - cuda.keys())}"
    # the CUDA build's own requirements are what the CUDA lock adds
    assert cuda["torch"] == cpu["torch"] and "triton" in cuda and any(n.startswith("nvidia-nccl") for n in cuda)


def make_n(*args: str, path: str | None = None) -> str:
    env = {**MAKE_ENV, **({"PATH": path} if path else {})}
    r = subprocess.run(["make", "-Bn", "install", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_install_uses_the_lock_of_its_build():
    cuda, cpu = make_n("CUDA=1"), make_n("CUDA=0")
    assert "-c constraints-cuda.txt" in cuda and "-c constraints.txt" not in cuda
    assert "-c constraints.txt" in cpu and "constraints-cuda.txt" not in cpu
    assert "touch .venv/.installed-cuda" in cuda and "touch .venv/.installed\n" in cpu
    # the check asserts the build each meant to install
    assert "'CUDA' == 'CUDA'" in cuda and "'CPU' == 'CUDA'" in cpu


def test_make_install_detects_an_nvidia_driver(tmp_path):
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    assert "-c constraints-cuda.txt" in make_n(path=path)
    assert "-c constraints.txt" in make_n("CUDA=0", path=path)
    if shutil.which("nvidia-smi") is None and not Path("/proc/driver/nvidia/version").exists():
        assert "-c constraints.txt" in make_n()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_scripts_parse_and_answer_help(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    r = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and f"bash bench/{script.name}" in r.stdout, r.stderr
    bad = subprocess.run(["bash", str(script), "--no-such-option"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr


def wheels(*args: str) -> list[str]:
    r = subprocess.run(["bash", str(SCRIPTS[0]), *args], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYBIN": sys.executable})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_wheel_sets_are_pinned():
    cpu, cuda = pins(ROOT / "constraints.txt"), pins(ROOT / "constraints-cuda.txt")
    train = dict(p.split("==") for p in wheels("--list"))
    assert "torch" not in train and not any(n.startswith("nvidia") for n in train)
    assert {norm(n): v for n, v in train.items() if norm(n) in cpu} == {n: cpu[n] for n in map(norm, train) if n in cpu}
    assert set(map(norm, train)) - set(cpu) == {"setuptools"}  # the one not in constraints.txt (pip freeze drops it)
    full = dict(p.split("==") for p in wheels("--list", "--set", "full"))
    assert {norm(n): v for n, v in full.items()} == cuda


# What the training path loads, in a fresh interpreter: the launcher and the rank's module, DeepSpeed, the two GPU
# benches, and the tiny corpus they tokenize. Two imports are optional (inside try/except) and blocked here as the
# GPU venv lacks them: deepspeed.autotuning's mlflow and pyarrow's pandas (its DataFrame checks); a 1-rank
# DeepSpeed run in a venv without them completes.
IMPORTS = r"""
import json, os, sys, sysconfig, tempfile
root = sys.argv[1]
sys.path[:0] = [root, os.path.join(root, "tests", "train")]
class Absent:  # a finder that makes them not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mlflow", "pandas"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
import importlib.metadata as md
import deepspeed, lifecycle.tasks.train.trainer, lifecycle.tasks.train.launch, bench.gpu_mfu, bench.kill_resume
from tests.faults import tokens
tokens(tempfile.mkdtemp())
dists = md.packages_distributions()
stdlib = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
out = {}
for name in {m.split(".")[0] for m, mod in list(sys.modules.items()) if mod is not None}:
    if name in sys.stdlib_module_names or name.startswith("__editable__"):
        continue
    file = getattr(sys.modules.get(name), "__file__", None) or ""
    if file.startswith(root + os.sep) and not file.startswith(sys.prefix + os.sep):
        continue  # lifecycle, bench, tests: this checkout (its .venv aside)
    if name in dists:
        out[name] = dists[name]
    elif file and not file.startswith(stdlib):
        out[name] = None  # a module of no known distribution
print(json.dumps(out))
"""


def test_train_wheel_set_covers_what_training_imports():
    r = subprocess.run([sys.executable, "-c", IMPORTS, str(ROOT)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert "deepspeed" in loaded and "torch" in loaded
    train = {norm(p.split("==")[0]) for p in wheels("--list")}
    omitted = [norm(n) for n in wheels("--list-omitted")]
    uncovered = {}
    for module, dist_names in loaded.items():
        assert dist_names, f"{module} was imported and belongs to no installed distribution"
        names = {norm(d) for d in dist_names}
        if names & train or any(fnmatch.fnmatch(n, pat) for n in names for pat in omitted):
            continue
        uncovered[module] = sorted(names)
    assert not uncovered, (f"the training path imports these, which bench/gpu_wheels.sh's train set neither "
                           f"ships nor lists as left to the GPU machine (OMITTED): {uncovered}")


SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"


def test_slurm_batch_script_writes_the_hostfile_and_sets_valid_fields(tmp_path):
    """deploy/slurm/train.sbatch under a fake SLURM job: its hostfile has one line per node with the job's GPUs
    per node, and `lifecycle config show` accepts the --set options it passes to `lifecycle run`."""
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$*" = "show hostnames gpu[01-03]" ] && printf "gpu01\\ngpu02\\ngpu03\\n"\n')
    (venv_bin / "lifecycle").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    for f in (bin_dir / "scontrol", venv_bin / "lifecycle"):
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_GPUS_PER_NODE": "h100:4",
           "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path), "VENV": str(tmp_path / "venv"),
           "ARGS_OUT": str(tmp_path / "args")}
    r = subprocess.run(["bash", str(SBATCH), "deploy/configs/demo.yaml", "--set", "train.max_steps=500"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hostfile-77").read_text() == "gpu01 slots=4\ngpu02 slots=4\ngpu03 slots=4\n"
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:2] == ["run", "deploy/configs/demo.yaml"] and args[-2:] == ["--set", "train.max_steps=500"]
    sets = dict(a.split("=", 1) for a in args[3::2])
    assert sets["train.launch.hostfile"] == str(tmp_path / "hostfile-77")
    assert sets["train.batch.num_ranks"] == "12" and sets["train.launch.master_addr"] == "gpu01"
    show = subprocess.run([str(Path(sys.executable).parent / "lifecycle"), "config", "show", *args[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert show.returncode == 0, show.stdout + show.stderr
    assert "* train.batch.num_ranks: 12" in show.stdout and '* train.launch.master_addr: "gpu01"' in show.stdout


def _gpu_figures_cpu_check(tmp_path, only: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_figures.sh"), "--cpu-check", "--python", sys.executable,
                           "--out", str(tmp_path), "--budget", "900", "--only", only], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "LIFECYCLE_COMMIT": "test"})


def test_gpu_figures_drives_bench_gpu_mfu_on_the_cpu(tmp_path):
    """The lease script and `bench.gpu_mfu` end to end on tiny shapes: ours (DeepSpeed rank, async saves), the
    synchronous-save run and the peer loop, one JSON line with every field the issue asks for."""
    r = _gpu_figures_cpu_check(tmp_path, "mfu124")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = (tmp_path / "summary.jsonl").read_text().splitlines()
    got = json.loads(line)
    assert got["commit"] == "test" and got["model"] == "tiny"
    assert not {"sync_error", "peer_error", "ours_compile_error"} & set(got), got
    for side in ("ours", "peer"):
        assert got[side]["tokens_per_s"] > 0 and got[side]["step_ms"] > 0
    assert got["ratio"] == pytest.approx(got["ours"]["tokens_per_s"] / got["peer"]["tokens_per_s"])
    assert 0 <= got["stall_frac"] < 1 and got["save_stall_ratio"] >= 0 and got["save"]["sync_s"] > 0
    assert got["save"]["first_async_s"] is not None and got["save"]["commit_after_s"]
    assert "6·N + 12·L·H·Q·T" in got["mfu_basis"]


@pytest.mark.slow
def test_gpu_figures_runs_every_step_on_the_cpu(tmp_path):
    """Every step (the two MFU runs, a kill-and-resume, the levers one at a time, the recovery modes) on the CPU,
    as a lease would run them on a GPU."""
    r = _gpu_figures_cpu_check(tmp_path, "mfu124,resume,mfu350,levers,recovery")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    *mfu, lev, rec = (json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines())
    assert set(rec["medians"]) == {"memory", "disk", "spare"} and rec["ratio"]["spare"]["relaunch"] > 0
    assert len(mfu) == 2 and all("ratio" in m for m in mfu)
    assert set(lev["levers"]) == {"all on", "compile", "fused_adamw", "no_host_sync", "pinned", "vocab_pad",
                                  "micro_batch"}
    assert all(v["tokens_per_s"] > 0 for v in lev["levers"].values())
    assert "1/1 killed-and-resumed runs bitwise-identical" in (tmp_path / "resume.log").read_text()


def test_system_packages_says_what_it_cannot_install_and_goes_on(tmp_path):
    """`make install` brings Debian's wordnet-base (deploy/system-packages.sh); where it cannot (no apt-get, no
    root or sudo), it says what METEOR will do without it and the install goes on (issue 41 §1)."""
    bindir = tmp_path / "bin"  # bash and id, but no apt-get or sudo
    bindir.mkdir()
    for tool in ("bash", "id", "grep"):
        (bindir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bindir), "LIFECYCLE_WORDNET_DIR": str(tmp_path / "no-wordnet")}
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "system-packages.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "wordnet-base is not installed and this user cannot install it" in proc.stderr
    assert "gen_meteor_nosyn" in proc.stderr
    (tmp_path / "no-wordnet").mkdir()
    (tmp_path / "no-wordnet" / "data.noun").write_text("")
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "system-packages.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""  # installed: nothing to do
