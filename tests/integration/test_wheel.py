"""What users install: a wheel built from the tree, installed into a fresh venv without the source
tree on its path, imports every module and runs an embedded job (the editable install hides a
package left out of the wheel)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers.corpus import manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _modules_in_tree() -> set[str]:
    """Every module the wheel must hold: batchinf/**, workers/** as batchinf.workers, migrations/**."""
    out = set()
    for top, name in (("batchinf", "batchinf"), ("workers", "batchinf.workers"), ("migrations", "batchinf.migrations")):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT / top).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.add(".".join([name, *parts]))
    return out


def _copy_of_the_tree(dest: Path) -> Path:
    """The files git would commit (tracked, plus untracked ones it does not ignore), copied: the
    wheel is built from what a clone holds, never from the working tree's build/ or egg-info left
    by an earlier build, and no other test writing into the tree meanwhile can reach the build."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding only the wheel; the test interpreter's dependencies (torch, pyarrow, ...)
    are on its path through a .pth line, which does not run the editable install's finder."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = _copy_of_the_tree(tmp / "source")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"),
                            str(source)], capture_output=True, text=True, cwd=tmp)
    assert build.returncode == 0, f"pip wheel failed:\n{build.stdout[-3000:]}\n{build.stderr[-6000:]}"
    (wheel,) = (tmp / "dist").glob("batchinf-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, cwd=tmp)
    return venv


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHINF_", "PYTHON"))}
    return {**env, "BATCHINF_HOME": str(home)}


def test_wheel_holds_every_module(wheel_venv: Path, tmp_path: Path) -> None:
    code = ("import batchinf, importlib, json, pkgutil, sys\n"
            "mods = {m.name for m in pkgutil.walk_packages(batchinf.__path__, 'batchinf.')} | {'batchinf'}\n"
            "print(json.dumps({'file': batchinf.__file__, 'modules': sorted(mods)}))")
    out = subprocess.run([str(wheel_venv / "bin" / "python"), "-c", code], check=True, capture_output=True,
                         text=True, cwd=tmp_path, env=_clean_env(tmp_path / "home")).stdout
    found = json.loads(out)
    assert found["file"].startswith(str(wheel_venv)), found["file"]    # the wheel, not the source tree
    missing = _modules_in_tree() - set(found["modules"])
    assert not missing, f"modules left out of the wheel: {sorted(missing)}"


def test_wheel_runs_an_embedded_job(wheel_venv: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    env = _clean_env(tmp_path / "home")
    cli = str(wheel_venv / "bin" / "batchinf")
    subprocess.run([cli, "bundle", "import", str(tiny_model_dir), "--name", "tiny", "--alias", "prod"],
                   check=True, capture_output=True, cwd=tmp_path, env=env)
    ids = write_jsonl(tmp_path / "in" / "a.jsonl", 60, seed=3, bad=False)
    (tmp_path / "job.json").write_text(json.dumps(manifest(str(tmp_path / "in") + "/", str(tmp_path / "out") + "/")))
    run = subprocess.run([cli, "run", str(tmp_path / "job.json"), "--workers", "1", "--json"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["status"] == "succeeded"
    assert result["counts"]["records_succeeded"] == len(ids)
    assert (tmp_path / "out" / "_SUCCESS").exists()
