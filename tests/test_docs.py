"""The documentation stays true to the code: the config page lists exactly the config's
fields with their defaults, the README stays a short user's document that states CI's test
command, no relative link in the docs points at a missing file, and every source path
named in the docs or a config comment exists."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import yaml

from tppo_jax.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIG_PAGE = ROOT / "docs" / "config.md"
TEST_COMMAND = ".venv/bin/python -m pytest -q"  # what .ci/run runs; the README must say it
MAX_README_LINES = 300

# A config-page row: | `section.key` | `default` | meaning |
ROW = re.compile(r"^\|\s*`(\w+\.\w+)`\s*\|\s*`([^`]*)`\s*\|")
# [text](target) with a relative target; anchors and titles stripped later.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def config_fields() -> dict[str, object]:
    """``{"section.field": default}`` over every section dataclass of ``Config``."""
    cfg = Config()
    out: dict[str, object] = {}
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        for f in dataclasses.fields(value):
            out[f"{section.name}.{f.name}"] = getattr(value, f.name)
    return out


def documented_keys() -> dict[str, str]:
    """``{"section.key": default text}`` from the config page's table rows."""
    rows: dict[str, str] = {}
    for line in CONFIG_PAGE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"docs/config.md documents {m.group(1)} twice"
            rows[m.group(1)] = m.group(2)
    return rows


def test_config_page_documents_exactly_the_config_fields():
    fields, documented = set(config_fields()), set(documented_keys())
    assert fields - documented == set(), "config fields missing from docs/config.md"
    assert documented - fields == set(), "docs/config.md documents keys the config lacks"


def _same(doc: object, default: object) -> bool:
    if isinstance(default, float) and isinstance(doc, int | float) and not isinstance(doc, bool):
        return math.isclose(doc, default)
    if isinstance(default, float) and isinstance(doc, str):  # YAML 1.1 reads 2e-4 as a string
        try:
            return math.isclose(float(doc), default)
        except ValueError:
            return False
    return doc == default and type(doc) is type(default)


def test_config_page_defaults_are_the_dataclass_defaults():
    defaults = config_fields()
    wrong = {k: (text, defaults[k]) for k, text in documented_keys().items()
             if k in defaults and not _same(yaml.safe_load(text), defaults[k])}
    assert wrong == {}, "docs/config.md default differs from tppo_jax/config.py (doc, code)"


def test_readme_is_short_and_states_the_ci_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert TEST_COMMAND in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci, "CI no longer runs the README's test command"
    assert ".venv/bin/ruff check ." in ci, "CI no longer lints"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces
    to dashes."""
    out = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"^#+\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(slug.replace(" ", "-"))
    return out


def _doc_files() -> list[Path]:
    return [README, ROOT / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(doc: Path):
    text = doc.read_text()
    # Links inside fenced code blocks are code, not links.
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (https:, gs:, mailto:)
        path, _, anchor = target.partition("#")
        dest = doc.parent / path if path else doc
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            missing.append(target)  # the page exists, the section does not
    assert missing == [], f"{doc.relative_to(ROOT)} links to missing files or sections"


# `results/NAME.ext` as the docs cite it; `git show COMMIT:results/...` (history) is not a cite.
RESULT_PATH = re.compile(r"(?<![\w:/.-])results/([\w./-]+\.(?:json|png|md))")


def test_results_holds_exactly_the_files_the_docs_cite():
    """``results/`` is the current figures only: every file in it is cited by the README,
    ``results/README.md`` or ``docs/`` (the results page may name its own files bare), and
    every ``results/`` path they cite exists."""
    docs = {p: p.read_text() for p in _doc_files()}
    cited = {m for text in docs.values() for m in RESULT_PATH.findall(text)}
    results = ROOT / "results"
    page = docs[results / "README.md"]
    present = {str(p.relative_to(results)) for p in results.rglob("*") if p.is_file()}
    uncited = sorted(f for f in present if f not in cited and f not in page)
    assert uncited == [], "files in results/ that no doc cites (remove them; git keeps them)"
    missing = sorted(f for f in cited if f not in present)
    assert missing == [], "docs cite results/ files that do not exist"


# A source file named in a doc (in backticks) or a config comment: `rewards/grader.py`.
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|ipynb))\b")


def _named_paths_missing(text: str, base: Path) -> list[str]:
    roots = (ROOT, ROOT / "tppo_jax", ROOT / "tests", base)
    missing = []
    for name in sorted(set(SOURCE_PATH.findall(text))):
        if "/" not in name:
            continue  # a bare file name (setup.py of a pip error, a user's script) is prose
        if not any((r / name).exists() for r in roots):
            missing.append(name)
    return missing


CONFIG_FILES = sorted((ROOT / "tppo_jax" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("doc", [*_doc_files(), *CONFIG_FILES],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_source_paths_named_in_docs_and_config_comments_exist(doc: Path):
    text = doc.read_text()
    if doc.suffix == ".md":
        text = " ".join(re.findall(r"`([^`\n]+)`", text))  # code spans name files
    else:
        text = "\n".join(line.partition("#")[2] for line in text.splitlines())  # comments
    assert _named_paths_missing(text, doc.parent) == [], f"{doc.relative_to(ROOT)} names " \
        "files that do not exist"
