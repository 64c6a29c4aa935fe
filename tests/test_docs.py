"""What the docs cite still resolves: every ``data/...`` path named in the README, CONTRIBUTING.md, docs/ and the
notebooks' markdown cells exists in the tree (a glob, ``decoder.*.json``, must match at least one file; a template,
``data/bench/<gpu>/<op>.json``, is not a path and is skipped)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w/.-])data/[\w.*/<>{}-]*")


def cited_texts() -> list[tuple[str, str]]:
    texts = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in
             [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))] if p.is_file()]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts += [(f"{nb.relative_to(ROOT).as_posix()} cell {i}", "".join(c["source"]))
                  for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    return texts


def cited_paths() -> list[tuple[str, str]]:
    found = set()
    for where, text in cited_texts():
        for m in PATH.finditer(text):
            path = m.group(0).rstrip(".,;:")
            if not any(c in path for c in "<>{}"):
                found.add((where, path))
    return sorted(found)


def test_some_paths_are_cited():
    assert len(cited_paths()) > 20


@pytest.mark.parametrize("where,path", cited_paths())
def test_cited_data_path_exists(where, path):
    if "*" in path:
        assert list(ROOT.glob(path)), f"{where} cites {path}, which matches nothing"
    else:
        assert (ROOT / path).exists(), f"{where} cites {path}, which does not exist"
