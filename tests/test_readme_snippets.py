"""README.md's runnable snippets run: every ```bash block preceded by a line `<!-- test -->` is run as pasted, in
bash with -e and pipefail, from a scratch copy of the repository's layout (deploy/, corpus/ and .venv linked) whose
`runs/demo` is a small committed work dir with `latest/` pointers, so the audit snippets answer in seconds.
Mark only blocks that run in seconds without a trained model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.core.latest import point_latest
from tests.conftest import ROOT, docs_table, make_collect

MARK = "<!-- test -->"


def snippets() -> list[tuple[int, str]]:
    """(line number of the block's first command, its text) for each marked block."""
    lines = (ROOT / "README.md").read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() == MARK:
            assert lines[i + 1].strip() == "```bash", f"README.md:{i + 1}: {MARK} must be followed by a ```bash block"
            end = lines.index("```", i + 2)
            out.append((i + 3, "\n".join(lines[i + 2:end])))
    return out


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    for name in ("deploy", "corpus"):
        (root / name).symlink_to(ROOT / name, target_is_directory=True)
    (root / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    wd = root / "runs" / "demo"
    ref = make_collect(wd, [docs_table(["The first document of the small work dir.", "A second one."])])
    point_latest(wd, {"collect": ref.dir})
    return root


def test_the_readme_marks_runnable_snippets():
    assert len(snippets()) >= 3


@pytest.mark.parametrize("line,code", snippets(), ids=[f"README.md:{n}" for n, _ in snippets()])
def test_readme_snippet_runs(layout, line, code):
    env = {k: v for k, v in os.environ.items() if k != "LIFECYCLE_WORKDIR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=layout, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README.md:{line} exit {proc.returncode}:\n{code}\n---\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"README.md:{line} printed nothing"
