"""The documentation: the MkDocs site builds in strict mode (every link and anchor resolves, every
generated reference section renders from the code), and README stays the short front door."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.docs_site import ROOT, rendered

README_MAX_LINES = 250


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`; mkdocs-material is in the test extras, so a missing one fails here."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                       env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_readme_is_the_short_front_door() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_generated_sections_are_rendered() -> None:
    """No marker is left behind, and each reference page names what its source defines."""
    cli, settings, manifest = rendered("reference/cli.md"), rendered("reference/settings.md"), rendered("reference/manifest.md")
    assert "<!-- generated:" not in cli + settings + manifest
    assert "`batchinf bundle import`" in cli and "`batchinf run`" in cli
    assert "`BATCHINF_HOME`" in settings and "`BATCHINF_LIMIT_MAX_SLOTS`" in settings
    assert "`idempotency_key`" in manifest and "## GenerateOptions" in manifest


def test_the_settings_page_names_every_variable_config_reads() -> None:
    read = set(re.findall(r'"((?:BATCHINF|PROMETHEUS)_[A-Z0-9_]+)"', (ROOT / "batchinf" / "config.py").read_text()))
    page = rendered("reference/settings.md")
    missing = sorted(v for v in read if f"`{v}`" not in page)
    assert not missing, f"docs/reference/settings.md does not render: {missing}"
