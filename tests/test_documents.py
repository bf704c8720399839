"""The documents: every link between them leads somewhere, and the exit statuses are the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hermes_batch import errors

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *REPO.glob("hermes_batch_*/README.md"), *REPO.glob("plugins/*/README.md")]


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes of a document's headings."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    headings = re.findall(r"(?m)^#{1,6} (.+)$", text)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not target.startswith(("http://", "https://"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_leads_to_a_file_and_heading_that_exist(document):
    broken = []
    for target in links(document.read_text()):
        path, _, anchor = target.partition("#")
        destination = (document.parent / path).resolve() if path else document
        if not destination.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(destination.read_text()):
            broken.append(target)
    assert broken == []


def test_the_readme_points_to_every_document():
    readme = (REPO / "README.md").read_text()
    for document in (REPO / "docs").glob("*.md"):
        assert f"(docs/{document.name})" in readme, document.name


def test_the_documented_exit_statuses_are_the_codes():
    text = (REPO / "docs" / "options.md").read_text()
    table = text.split("## Exit status", 1)[1].split("\n\n")[1]
    documented = {int(row.split("|")[1]) for row in table.splitlines()[2:]}
    assert documented == {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
