"""Every command error is one clear line on stderr, exit status 2, and no traceback without -v (issue 21, item 10).

Each case is what an adversarial user or an unlucky operator tries on one subcommand: a missing, empty, unreadable
or non-UTF-8 file, a directory where a file belongs (and the other way round), YAML that is a list, unknown keys and
bad values in --set, damaged manifests, refused queries, a dead tracking server. Under --json the same error is
also one JSON object on stdout. A bug (not a user error) is one line too, exit 1, and -v shows its traceback.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from lifecycle.cli import main
from lifecycle.core.procs import free_port
from tests.conftest import ROOT

DEMO = str(ROOT / "deploy/configs/demo.yaml")


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """`lifecycle ARGV` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc: int, err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _write(path: pathlib.Path, data: bytes | str) -> pathlib.Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _workdir(t: pathlib.Path) -> pathlib.Path:
    (t / "datasets").mkdir()
    return t


def _damaged_servers_json(t: pathlib.Path) -> pathlib.Path:
    (t / ".servers").mkdir()
    _write(t / ".servers" / "servers.json", '{"prefect": {"pid": 1,')
    return t


def _dead_port() -> int:
    return free_port()  # nothing listens there


# each case: (id, argv builder(tmp_path) -> argv, substrings the one stderr line must hold; "{t}" is tmp_path)
CASES = [
    ("run-config-not-utf8", lambda t: ["run", _write(t / "bad.yaml", b"name: x\nworkdir: \xff\xfe\n")],
     ["lifecycle run: error:", "bad.yaml", "not UTF-8"]),
    ("run-config-is-a-directory", lambda t: ["run", t], ["lifecycle run: error:", "{t}", "is a directory"]),
    ("run-config-missing", lambda t: ["run", t / "nope.yaml"], ["config file not found", "nope.yaml"]),
    ("run-config-empty", lambda t: ["run", _write(t / "empty.yaml", "")],
     ["invalid config", "empty.yaml", "field `collect`"]),
    ("run-config-a-list", lambda t: ["run", _write(t / "list.yaml", "- a\n- b\n")],
     ["list.yaml", "top level must be a mapping"]),
    ("run-config-bad-yaml", lambda t: ["run", _write(t / "broken.yaml", "collect: [unclosed\nname: {\n")],
     ["broken.yaml", "not valid YAML"]),
    ("run-set-unknown-key", lambda t: ["run", DEMO, "--set", "train.no_such_field=1"],
     ["invalid config", "train.no_such_field", "Extra inputs are not permitted"]),
    ("run-set-bad-value", lambda t: ["run", DEMO, "--set", "train.max_steps=lots"],
     ["train.max_steps", "'lots'"]),
    ("run-set-two-bad-values", lambda t: ["run", DEMO, "--set", "train.max_steps=-1", "--set", "name=[1]"],
     ["train.max_steps", "field `name`"]),
    ("run-set-no-equals", lambda t: ["run", DEMO, "--set", "train.max_steps"], ["expected KEY=VALUE"]),
    ("run-set-bad-yaml", lambda t: ["run", DEMO, "--set", "name=[unclosed"], ["--set name", "not valid YAML"]),
    ("run-set-into-a-value", lambda t: ["run", DEMO, "--set", "name.x=1"], ["--set name.x", "not a section"]),
    ("run-workdir-is-a-file", lambda t: ["run", DEMO, "--set", f"workdir={_write(t / 'wd', 'x')}"],
     ["work dir", "{t}/wd", "not a directory"]),
    ("run-workdir-under-a-file", lambda t: ["run", DEMO, "--set", f"workdir={_write(t / 'f', 'x')}/sub"],
     ["work dir", "{t}/f", "not a directory"]),
    ("run-workdir-cannot-be-created", lambda t: ["run", DEMO, "--set", "workdir=/proc/lifecycle-test"],
     ["work dir /proc/lifecycle-test: cannot create it"]),
    ("run-until-unknown-stage", lambda t: ["run", DEMO, "--until", "nope"],
     ["lifecycle run: error:", "invalid choice: 'nope'", "--help"]),
    ("no-command", lambda t: [], ["lifecycle: error:", "command"]),
    ("unknown-option", lambda t: ["verify", "--frobnicate"], ["lifecycle verify: error:", "--frobnicate"]),
    ("plan-dataset-nonexistent", lambda t: ["plan", "--dataset", "/nonexistent"],
     ["lifecycle plan: error:", "no such file or directory", "/nonexistent"]),
    ("plan-dataset-empty-dir", lambda t: ["plan", "--dataset", t],
     ["no such file or directory", "{t}/_manifest.json"]),
    ("plan-dataset-truncated-manifest", lambda t: ["plan", "--dataset", _write(t / "_manifest.json", '{"stage": "to')],
     ["--dataset", "_manifest.json", "Unterminated string"]),
    ("plan-dataset-not-utf8", lambda t: ["plan", "--dataset", _write(t / "_manifest.json", b'{"stage": "\xff"}')],
     ["--dataset", "_manifest.json"]),
    ("plan-dataset-wrong-stage", lambda t: ["plan", "--dataset", _write(t / "_manifest.json", '{"stage": "collect"}')],
     ["not a tokenize dataset manifest"]),
    ("plan-dataset-no-tokens", lambda t: ["plan", "--dataset", _write(t / "_manifest.json", '{"stage": "tokenize"}')],
     ["its manifest has no 'num_tokens' field"]),
    ("plan-negative-budget", lambda t: ["plan", "--tokens", "-5"], ["lifecycle plan: error:"]),
    ("plan-infinite-budget", lambda t: ["plan", "--tokens", "1e400"], ["--tokens must be a finite number"]),
    ("plan-not-a-number", lambda t: ["plan", "--flops", "lots"], ["invalid float value: 'lots'"]),
    ("verify-workdir-missing", lambda t: ["verify", "--workdir", t / "nope"], ["{t}/nope", "no such directory"]),
    ("sql-workdir-missing", lambda t: ["sql", "SELECT 1", "--workdir", t / "nope"],
     ["lifecycle sql: error:", "--workdir", "no such directory"]),
    ("sql-not-a-workdir", lambda t: ["sql", "SELECT 1", "--workdir", t], ["has no datasets/ directory"]),
    ("sql-not-a-select", lambda t: ["sql", "DROP TABLE datasets", "--workdir", _workdir(t)], ["only SELECT queries"]),
    ("sql-empty-query", lambda t: ["sql", " ;", "--workdir", _workdir(t)], ["no SQL statement given"]),
    ("sql-unknown-column", lambda t: ["sql", "SELECT nope FROM datasets", "--workdir", _workdir(t)], ["nope"]),
    ("sql-dead-tracking-server", lambda t: ["sql", "SELECT 1", "--workdir", _workdir(t), "--tracking-uri",
                                            f"http://127.0.0.1:{_dead_port()}"],
     ["MLflow tracking server http://127.0.0.1:", "does not answer"]),
    ("lineage-doc-workdir-missing", lambda t: ["lineage", "doc", "x", "--workdir", t / "nope"],
     ["lifecycle lineage doc: error:", "no such directory"]),
    ("lineage-model-no-store", lambda t: ["lineage", "model", "m", "--workdir", t], ["has no mlflow.db"]),
    ("lineage-model-store-missing", lambda t: ["lineage", "model", "m", "--workdir", t, "--tracking-uri",
                                               f"sqlite:///{t}/mlflow.db"], ["no MLflow store at {t}/mlflow.db"]),
    ("lineage-forget-workdir-a-file", lambda t: ["lineage", "forget", "s", "--workdir", _write(t / "f", "x")],
     ["lifecycle lineage forget: error:", "no such directory"]),
    ("export-checkpoint-missing", lambda t: ["export", "hf", t / "ckpt", t / "out", "--workdir", t],
     ["lifecycle export hf: error:", "{t}/ckpt"]),
    ("export-checkpoint-outside", lambda t: ["export", "hf", "/etc", t / "out", "--workdir", t],
     ["lifecycle export hf: error:", "/etc", "not inside"]),
    ("status-config-missing", lambda t: ["status", t / "nope.yaml"], ["lifecycle status: error:", "nope.yaml"]),
    ("status-servers-json-damaged", lambda t: ["status", DEMO, "--set", f"workdir={_damaged_servers_json(t)}"],
     ["{t}/.servers/servers.json", "not valid JSON"]),
    ("down-config-a-list", lambda t: ["down", _write(t / "l.yaml", "[1, 2]")], ["top level must be a mapping"]),
    ("serve-without-a-server", lambda t: ["serve", DEMO, "--cron", "* * * * *", "--set", f"workdir={t}"],
     ["lifecycle serve: error:", "needs a real Prefect server"]),
    ("serve-config-not-utf8", lambda t: ["serve", _write(t / "c.yaml", b"\xff"), "--cron", "* * * * *"],
     ["c.yaml", "not UTF-8"]),
]


@pytest.mark.parametrize("build,needles", [pytest.param(b, n, id=i) for i, b, n in CASES])
def test_command_error_is_one_line_exit_2(capsys, tmp_path, monkeypatch, build, needles):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    rc, out, err = run_cli(capsys, build(tmp_path))
    assert_one_line(rc, err, *(n.format(t=tmp_path) for n in needles))


@pytest.mark.parametrize("build,needles", [pytest.param(b, n, id=i) for i, b, n in CASES
                                           if i.startswith(("run-", "plan-dataset", "sql-", "lineage-", "export-"))])
def test_json_error_is_one_json_line(capsys, tmp_path, monkeypatch, build, needles):
    """Under --json, stdout's last line is one JSON object describing the same error."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    rc, out, err = run_cli(capsys, build(tmp_path) + ["--json"])
    line = assert_one_line(rc, err, *(n.format(t=tmp_path) for n in needles))
    got = json.loads(out.strip().splitlines()[-1])
    assert got["error"] == line and got["status"] in ("invalid_config", "error", "usage_error")


def test_unreadable_config(capsys, tmp_path, monkeypatch):
    """chmod 000: one line naming the file. Root reads any file, so there the kernel's answer is simulated."""
    cfg = _write(tmp_path / "secret.yaml", "name: x\n")
    cfg.chmod(0)
    if os.geteuid() == 0:
        real = pathlib.Path.read_text

        def denied(self, *a, **kw):
            if self == cfg:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real(self, *a, **kw)

        monkeypatch.setattr(pathlib.Path, "read_text", denied)
    rc, out, err = run_cli(capsys, ["run", cfg, "--json"])
    line = assert_one_line(rc, err, str(cfg), "permission denied")
    assert json.loads(out.strip().splitlines()[-1])["error"] == line


def test_port_in_use_for_up(capsys, tmp_path):
    """`lifecycle up` on a port something else holds: one line naming the port, and nothing is started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out, err = run_cli(capsys, ["up", DEMO, "--set", f"workdir={tmp_path}", "--prefect-port", port,
                                        "--mlflow-port", free_port()])
    assert_one_line(rc, err, f"port {port}", "already in use")
    assert not (tmp_path / ".servers" / "servers.json").exists()


def test_a_bug_is_one_line_exit_1_and_verbose_shows_the_traceback(capsys, monkeypatch, tmp_path):
    import lifecycle.cli as cli

    def broken(args):
        return {}["no such key"]

    monkeypatch.setattr(cli, "cmd_verify", broken)
    monkeypatch.setenv("LIFECYCLE_WORKDIR", str(tmp_path))  # a named run: no note about the default work dir
    rc, out, err = run_cli(capsys, ["verify"])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err
    assert "lifecycle verify: internal error: KeyError" in lines[0] and "-v" in lines[0]
    rc, out, err = run_cli(capsys, ["verify", "-v"])
    assert rc == 1 and "Traceback" in err and "no such key" in err
    # a user error shows its traceback with -v too
    rc, out, err = run_cli(capsys, ["plan", "--dataset", "/nonexistent", "-v"])
    assert rc == 2 and "Traceback" in err and "FileNotFoundError" in err


@pytest.mark.parametrize("argv", [
    ["run", "{cfg}"], ["run", "{cfg}", "--json"], ["run", "{dir}"], ["plan", "--dataset", "/nonexistent"]])
def test_the_reported_cases_as_a_user_runs_them(tmp_path, argv):
    """The three reproductions of the issue, in a new process as a user types them."""
    cfg = _write(tmp_path / "c.yaml", b"name: \xff\n")
    argv = [a.format(cfg=cfg, dir=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "lifecycle.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    line = assert_one_line(proc.returncode, proc.stderr)
    assert line.startswith(f"lifecycle {argv[0]}: error:")
    if "--json" in argv:
        assert json.loads(proc.stdout.strip().splitlines()[-1])["error"] == line


def test_a_full_disk_is_named_whatever_error_it_surfaces_as(tmp_path, monkeypatch):
    """Chaos round 11 (seed 10): a full disk surfaced as MLflow's SQLAlchemy error, with the INSERT's statement
    and row in the one line; a full disk in the embedded server's start-up as `server exited (exit 3)`."""
    import shutil

    from lifecycle import cli

    msg = ("(raised as a result of Query-invoked autoflush); (sqlite3.OperationalError) database or disk is full\n"
           "[SQL: INSERT INTO runs (run_uuid, name) VALUES (?, ?)]\n[parameters: ('4dba', 'train')]\n"
           "(Background on this error at: https://sqlalche.me/e/20/e3q8)")
    line = cli.without_sql(cli.one_line(msg))
    assert line == "(sqlite3.OperationalError) database or disk is full"
    chaos = ("MlflowException: (raised as a result of Query-invoked autoflush; consider using a session.no_autoflush "
             "block if this flush is occurring prematurely); (sqlite3.OperationalError) database or disk is full")
    assert cli.without_sql(chaos) == "MlflowException: (sqlite3.OperationalError) database or disk is full"
    assert cli.without_sql("no SQL here; fine") == "no SQL here; fine"
    full = f"; the file system of {tmp_path} is full ("
    assert full in cli.disk_full_hint(RuntimeError(msg), str(tmp_path))  # the message says so
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("could not write the manifest") from inner
    except RuntimeError as e:
        chained = e
    assert full in cli.disk_full_hint(chained, str(tmp_path))  # its cause says so
    assert cli.disk_full_hint(RuntimeError("the embedded Prefect server exited during start-up (exit 3)"),
                              str(tmp_path)) == ""  # nothing says so and the disk has room: no hint
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 4096))
    hint = cli.disk_full_hint(RuntimeError("the embedded Prefect server exited during start-up (exit 3)"),
                              str(tmp_path))
    assert hint == (f"; the file system of {tmp_path} is full (4,096 bytes free): free space there and rerun, the "
                    "committed stages and checkpoints are reused")
