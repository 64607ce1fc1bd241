"""algorithms.catalog: one entry per recipe, real citations, and a listing without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from algorithms import RECIPES
from algorithms.catalog import CATALOG, PAPERS
from engine.config import ALGORITHMS, NON_PRIVATE

ROOT = Path(__file__).resolve().parents[2]


def test_every_recipe_has_one_catalog_entry_that_agrees_with_it() -> None:
    assert list(CATALOG) == list(RECIPES) == list(ALGORITHMS)
    for name, recipe in RECIPES.items():
        entry = CATALOG[name]
        assert recipe.private == entry.private
        assert recipe.summary == entry.summary
        assert recipe.paper == entry.citation()
        assert all(k in PAPERS for k in entry.papers)
        assert entry.private == (name not in NON_PRIVATE)  # what the CLI's check uses


def test_citations_are_papers_not_placeholders() -> None:
    for key, paper in PAPERS.items():
        m = re.fullmatch(r"(\d{2})(\d{2})\.(\d{4,5})", paper.arxiv)
        assert m is not None, key
        assert 1 <= int(m.group(2)) <= 12, key
        # a venue cannot predate the arXiv listing's year by more than one year
        assert paper.year >= 2000 + int(m.group(1)), key
        assert paper.title and "seed" not in paper.title.lower(), key
        assert paper.authors.count(",") >= 1 or " " in paper.authors, key
    for e in CATALOG.values():
        assert "seed" not in e.citation().lower()


def test_listing_algorithms_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys\n"
        "from engine.cli import main\n"
        "assert main(['algorithms']) == 0\n"
        "print(sorted(m for m in ('torch', 'ray', 'pandas') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[-1] == "[]"
    listed = [line.split()[0] for line in done.stdout.splitlines()[:-1]]
    assert listed == list(CATALOG)


def test_doc_sections_cited_by_code_exist() -> None:
    doc = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
    sections = {int(n) for n in re.findall(r"^## §(\d+)\b", doc, flags=re.M)}
    assert {e.section for e in CATALOG.values()} <= sections
    cited: set[int] = set()
    for folder in ("engine", "algorithms", "tuning", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            # the project's own doc only: no file outside the repository, by either spelling
            assert "ALGORITHMS" + ".md" not in text, path
            assert not re.search("ALGORITHMS" + r"\s*§", text), path
            for m in re.finditer(r"docs/algorithms\.md((?: ?§\d+(?:[–,-]+ ?§?\d+)*)+)", text):
                cited |= {int(n) for n in re.findall(r"\d+", m.group(1))}
    assert cited and cited <= sections, cited - sections


def test_readme_algorithms_table_is_the_registrys(capsys) -> None:
    """The README's table is what the recipe registry renders (one source); a recipe
    added to the registry without its README row fails here."""
    from algorithms.recipes import markdown_table
    from engine.cli import main

    table = markdown_table()
    assert table in (ROOT / "README.md").read_text()
    assert len(table.splitlines()) == 2 + len(RECIPES)
    assert main(["algorithms", "--markdown"]) == 0
    assert capsys.readouterr().out == table + "\n"


def test_tune_spaces_and_config_names_come_from_the_registry() -> None:
    from tuning.spaces import PER_RECIPE

    assert ALGORITHMS == tuple(RECIPES)
    assert NON_PRIVATE == tuple(n for n, r in RECIPES.items() if not r.private)
    for name, recipe in RECIPES.items():
        assert PER_RECIPE.get(name, {}) == recipe.search_space
        for key in recipe.search_space:  # a searched algo key is one the recipe reads
            if key.startswith("algo."):  # (dp_ftrl also searches server.lr)
                assert key.split(".", 1)[1] in recipe.hyperparameters, (name, key)
