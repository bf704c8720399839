"""Every distribution of this repository: one layout, and a wheel that holds its own package and nothing else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The home of every plugin distribution: three backends at the top level, the rest under plugins/.
PLUGIN_FOLDERS = sorted(
    [path for path in REPO.glob("hermes_batch_*") if (path / "pyproject.toml").exists()]
    + [path for path in (REPO / "plugins").iterdir() if (path / "pyproject.toml").exists()]
)


def _pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def test_every_distribution_is_found():
    names = {folder.name for folder in PLUGIN_FOLDERS}
    assert {"hermes_batch_docker", "hermes_batch_singularity", "hermes_batch_modal", "hermes_batch_example",
            "hermes_batch_toolbox", "hermes_batch_filters", "hermes_batch_parquet"} <= names
    # no stray pyproject.toml elsewhere: a distribution outside these homes would escape the checks below
    # (tests/third_party/ holds a third party's distribution, a fixture of tests/test_third_party_plugin.py)
    found = {path.parent for path in REPO.glob("**/pyproject.toml") if ".venv" not in path.parts and "build" not in path.parts}
    assert found == {REPO, *PLUGIN_FOLDERS, *(REPO / "tests" / "third_party").glob("*")}


@pytest.mark.parametrize("folder", PLUGIN_FOLDERS, ids=lambda path: path.name)
def test_plugin_distributions_share_one_layout(folder):
    thing = folder.name.removeprefix("hermes_batch_")
    project = _pyproject(folder)
    assert project["project"]["name"] == f"hermes-batch-{thing}"
    assert project["project"]["readme"] == "README.md" and (folder / "README.md").exists()
    assert "hermes-batch" in project["project"]["dependencies"]
    assert project["project"]["entry-points"]["hermes_batch"] == {thing: folder.name}
    assert project["tool"]["setuptools"]["packages"]["find"] == {"where": ["src"]}
    assert (folder / "src" / folder.name / "__init__.py").exists()
    assert (folder / "tests").is_dir()
    assert [path.name for path in (folder / "src").iterdir() if not path.name.endswith(".egg-info")] == [folder.name]


def test_the_suite_collects_every_distributions_tests():
    testpaths = _pyproject(REPO)["tool"]["pytest"]["ini_options"]["testpaths"]
    assert sorted(testpaths) == sorted(["tests", *(str(f.relative_to(REPO)) for f in PLUGIN_FOLDERS)])


_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "data", "*.egg-info", "__pycache__", ".pytest_cache")


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """A copy of the repository to build from: setuptools leaves build/ and *.egg-info folders behind.

    The core's copy keeps the plugin folders beside it, where a too wide package pattern would find them.
    """
    source = tmp_path_factory.mktemp("packaging") / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCES)
    return source


@pytest.mark.parametrize("folder", [REPO, *PLUGIN_FOLDERS], ids=lambda path: path.name if path != REPO else "hermes_batch")
def test_each_wheel_holds_only_its_own_package(folder, source_tree, tmp_path):
    package = "hermes_batch" if folder == REPO else folder.name
    # no build isolation: setuptools comes from the test extra, so this works offline and fast
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--wheel-dir", str(tmp_path), str(source_tree / folder.relative_to(REPO))],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
    top = {name.split("/")[0] for name in files}
    dist_info = {name for name in top if name.endswith(".dist-info")}
    assert top - dist_info == {package}, f"the wheel of {package} holds {sorted(top - dist_info)}"
    assert f"{package}/__init__.py" in files
    assert not [name for name in files if "/tests/" in name or name.endswith("conftest.py")]
    if package == "hermes_batch":
        assert "hermes_batch/testing/sandbox_contract.py" in files  # the plugin author's kit ships with the core
        assert "hermes_batch/local_sandbox/namespace_init.c" in files  # built where it runs
