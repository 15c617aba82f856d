"""`lifecycle export hf` writes where the user says (issue 24): OUT_DIR outside the work dir is fine, a folder that
holds files is refused unless --force, and the exported files get the umask's mode (0644), not 0600."""

from __future__ import annotations

import os
import stat

import pytest

from lifecycle.cli import main
from tests.eval.test_export_hf import committed, tokenizer_file  # noqa: F401 (a fixture)


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_export_writes_outside_the_workdir_refuses_a_full_folder_and_uses_normal_modes(tmp_path, tokenizer_file,
                                                                                       capsys, umask_022):
    wd, out = tmp_path / "w", tmp_path / "elsewhere" / "hf"
    tag, _ = committed(wd)
    tok = wd / "tokenizer.json"
    tok.write_bytes(tokenizer_file.read_bytes())
    argv = ["export", "hf", str(tag), str(out), "--tokenizer", str(tok), "--workdir", str(wd)]
    assert main(argv) == 0
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    before = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 2  # not empty now
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lifecycle export hf: error: OUT_DIR {out} is not empty: pass --force to write into it (files "
                   "of the same name are replaced)"]
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert main([*argv, "--force"]) == 0
    assert (out / "model.safetensors").stat().st_mtime_ns != before


def test_an_empty_existing_folder_is_fine_and_a_file_is_refused(tmp_path, tokenizer_file, capsys):
    wd = tmp_path / "w"
    tag, _ = committed(wd)
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    base = ["export", "hf", str(tag), "--tokenizer", str(tokenizer_file), "--workdir", str(wd),
            "--input-root", str(tokenizer_file.parent)]
    assert main([*base[:3], str(tmp_path / "empty"), *base[3:]]) == 0
    capsys.readouterr()
    assert main([*base[:3], str(tmp_path / "afile"), *base[3:], "--force"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
