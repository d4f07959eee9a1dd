"""The README's two commands, CI and the demo stay in step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_starts_with_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    head = readme.split("\n## ", 1)[0]
    assert len(re.findall(r"```bash\n", head)) == 2
    demo, tests = _readme_commands()[:2]
    assert "examples/demo.py" in demo and "-c constraints.txt" in demo
    assert "pytest" in tests and '".[test]"' in tests and "-c constraints.txt" in tests


def test_ci_runs_the_readme_test_command_verbatim():
    assert _readme_commands()[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_torch_pin_lives_in_the_constraints_file_not_the_package():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "torch==" not in (ROOT / "pyproject.toml").read_text()


def test_adapters_install_as_torchlike_adapters_not_a_top_level_package(tmp_path):
    probe = ("import importlib.util, torchlike.adapters; "
             "print(importlib.util.find_spec('adapters'), torchlike.adapters.__file__)")
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True)
    top_level, installed = completed.stdout.split()
    assert top_level == "None"
    assert Path(installed).parent == ROOT / "adapters"


def test_demo_runs_on_the_embedded_default_and_the_export_agrees(tmp_path):
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--out", str(tmp_path / "x")],
                               capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "(OK)" in completed.stdout
    assert (tmp_path / "x" / "model.safetensors").is_file()


def test_every_package_folder_is_listed_for_the_wheel():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"torchlike." + ".".join(p.parent.relative_to(ROOT / "torchlike").parts) if p.parent != ROOT / "torchlike"
             else "torchlike" for p in (ROOT / "torchlike").rglob("__init__.py")}
    found |= {"torchlike.adapters" + "".join("." + part for part in p.parent.relative_to(ROOT / "adapters").parts)
              for p in (ROOT / "adapters").rglob("__init__.py")}
    assert found == listed
