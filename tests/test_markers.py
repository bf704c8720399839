"""The markers of what a test needs (the root conftest.py): each registered, each table entry still a test."""

from __future__ import annotations

import ast
import functools
import importlib.util
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


def root_conftest():
    spec = importlib.util.spec_from_file_location("hermes_batch_root_conftest", REPO / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NEEDS = root_conftest()


def pytest_settings() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def test_every_need_is_a_registered_marker_and_markers_are_strict():
    registered = {line.split(":", 1)[0] for line in pytest_settings()["markers"]}
    assert set(NEEDS.NEEDS) <= registered
    used = set(NEEDS.NEEDS_OF_FIXTURES.values()) | {need for needs in NEEDS.NEEDS_OF_TESTS.values() for need in needs}
    assert used <= set(NEEDS.NEEDS), used - set(NEEDS.NEEDS)
    assert "--strict-markers" in pytest_settings()["addopts"]


@functools.cache  # each of the hundred-odd parametrisations below reads the same few files
def defined_names(path: Path) -> frozenset[str]:
    """The functions, methods and classes of a file."""
    tree = ast.parse(path.read_text())
    return frozenset(node.name for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


# the kits test classes subclass (SandboxContract): their tests are the classes' tests
KITS = sorted((REPO / "hermes_batch" / "testing").glob("*.py"))


@pytest.mark.parametrize("key", sorted(NEEDS.NEEDS_OF_TESTS))
def test_every_test_of_the_table_exists(key):
    """A renamed or deleted test must leave the table too: an entry that names nothing marks nothing."""
    path, _, name = key.partition("::")
    assert (REPO / path).is_file(), f"{path} does not exist: update NEEDS_OF_TESTS in the root conftest.py"
    cls, _, method = name.rpartition("::")
    if cls:  # file::Class::name: the class is the file's, the test its own or a kit's
        assert cls in defined_names(REPO / path), f"{key} is not a test: update NEEDS_OF_TESTS in the root conftest.py"
        assert any(method in defined_names(where) for where in [REPO / path, *KITS]), f"{key} is not a test"
    elif name:
        name = name.split("[", 1)[0]  # file::name[id]: one parametrisation of it
        assert name in defined_names(REPO / path), f"{key} is not a test: update NEEDS_OF_TESTS in the root conftest.py"


@pytest.mark.parametrize("fixture", sorted(NEEDS.NEEDS_OF_FIXTURES))
def test_every_fixture_of_the_table_exists(fixture):
    folders = [REPO / "tests", *REPO.glob("plugins/*/tests"), *REPO.glob("hermes_batch_*/tests")]
    files = [path for folder in folders for path in folder.glob("*.py")]
    # parsed only where the name is in the text: parsing every test file takes a second
    assert any(fixture in defined_names(path) for path in files if fixture in path.read_text()), \
        f"no fixture {fixture}: update NEEDS_OF_FIXTURES"


def item(path: str, name: str, fixtures=(), cls=None):
    return SimpleNamespace(path=REPO / path, name=name, originalname=name.split("[")[0], fixturenames=list(fixtures),
                           config=SimpleNamespace(rootpath=REPO), cls=cls)


def test_a_test_needs_what_its_fixtures_and_the_table_say():
    needs = NEEDS._needs
    assert needs(item("hermes_batch_docker/tests/test_x.py", "test_a", ["tmp_path", "run_name", "docker_api"])) == {"docker"}
    assert needs(item("hermes_batch_docker/tests/test_x.py", "test_b", ["tmp_path"])) == set()  # a unit test runs anywhere
    assert needs(item("tests/test_view_report.py", "test_c", ["page", "browser", "demo_run_dir"])) == {"browser"}
    assert needs(item("plugins/hermes_batch_toolbox/tests/test_open_files.py", "test_d")) == {"browser", "slow"}
    assert needs(item("tests/test_model_transport.py", "test_a_gzip_answer_is_capped_once_decompressed[httpx]",
                      ["backend"])) == {"perf"}  # every parametrisation
    assert needs(item("tests/test_model_transport.py", "test_something_else", ["backend"])) == set()
    # one parametrisation, by its id
    timeout = "test_prompt_timeout_applies_to_a_session_waiting_for_its_batch"
    assert needs(item("tests/test_batch_api.py", f"{timeout}[processes]")) == {"slow"}
    assert needs(item("tests/test_batch_api.py", f"{timeout}[local]")) == set()
    # a class, or one test of a class (inherited from a kit or not), by the class that collects it
    bash_helper = type("TestLocalSandboxContractBashHelper", (), {})
    assert needs(item("tests/test_local_sandbox.py", "test_exit_codes", cls=bash_helper)) == {"slow"}
    default_mode = type("TestLocalSandboxContract", (), {})
    assert needs(item("tests/test_local_sandbox.py", "test_exit_codes", cls=default_mode)) == set()
    assert needs(item("tests/test_local_sandbox.py", "test_timeout_kills_the_whole_process_tree", cls=default_mode)) == {"slow"}


def test_the_ray_tests_share_one_worker_and_so_one_cluster():
    added = []
    fake = item("plugins/hermes_batch_ray/tests/test_ray_executor.py", "test_x", ["ray_cluster"])
    fake.add_marker = added.append
    NEEDS.pytest_collection_modifyitems(None, [fake])
    groups = [decorator.mark for decorator in added if not isinstance(decorator, str)]
    assert "ray" in added and [(g.name, g.args) for g in groups] == [("xdist_group", ("ray",))]


def test_no_test_file_marks_what_it_needs_itself():
    """The tables of the root conftest.py are the one place that says what a test needs: a `@pytest.mark.slow` in a
    test file would be a second place to look (and one a reader of the tables would miss)."""
    import re

    inline = re.compile(r"\bmark\.(%s)\b" % "|".join(NEEDS.NEEDS))
    folders = [REPO / "tests", *REPO.glob("plugins/*/tests"), *REPO.glob("hermes_batch_*/tests"), REPO / "hermes_batch"]
    found = [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}"
             for folder in folders for path in sorted(folder.rglob("*.py")) if path.name != "test_markers.py"
             for text in [path.read_text()] for match in inline.finditer(text)]
    assert not found, f"mark these in NEEDS_OF_TESTS of the root conftest.py instead: {found}"


def test_no_test_module_imports_a_browser_library_when_collected():
    # The everyday run has no Playwright (scripts/test.sh --all installs it): a module-level import made the
    # whole file an error there, browser-marked tests or not.
    offenders = []
    for path in sorted({*REPO.glob("tests/*.py"), *REPO.glob("hermes_batch_*/tests/*.py")}):
        for node in ast.parse(path.read_text()).body:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] in ("playwright", "selenium") for name in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == [], offenders
