"""The README is a short front door whose links resolve; the reference is docs/, every page in the site's nav,
and the site builds with --strict (no broken link, anchor or included README section); every published report
is indexed with its command and carries a verdict table."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from e2e import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"


def nav_pages(nav) -> set[str]:
    """Every page a mkdocs ``nav`` lists, at any depth."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(nav_pages(value) for value in nav.values()))
    return set().union(*(nav_pages(item) for item in nav))


def mkdocs_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())  # no !!python tags in it, so a safe load reads it


def test_the_readme_is_short_and_its_table_cells_are_too():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    cells = [cell.strip() for line in lines if line.startswith("|") for cell in line.strip("|").split(" | ")]
    assert not [cell for cell in cells if len(cell) > 200]


def test_every_relative_link_of_the_readme_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into docs/"
    assert not [link for link in local if not (REPO / link).exists()]


def test_every_docs_page_is_in_the_nav():
    config = mkdocs_config()
    assert config["theme"]["name"] == "material"
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages == nav_pages(config["nav"])


def test_the_readme_sections_the_docs_include_exist():
    readme = README.read_text()
    included = {name for page in DOCS.rglob("*.md")
                for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page.read_text(), re.M)}
    assert included
    for name in included:
        start, end = f"--8<-- [start:{name}]", f"--8<-- [end:{name}]"
        assert start in readme and end in readme and readme.index(start) < readme.index(end)


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert "The same chain from Python" in (tmp_path / "site" / "pipeline" / "index.html").read_text()


def test_the_sweep_snippet_of_the_experiments_page_plans_on_the_pages_example(tmp_path):
    """docs/experiments.md's example with its seeds-and-sweep snippet added plans the trainings the page
    says (three of SimCLR, shared across the grid, and six of X-CLR)."""
    from repsim.experiment import check_experiment, expand, load_experiment

    page = (REPO / "docs" / "experiments.md").read_text()
    example, snippet = re.findall(r"```yaml\n(.*?)```", page, re.S)[:2]
    for folder in ("configs", "data_specs"):  # the page's relative paths, as from a file in experiments/
        (tmp_path / folder).symlink_to(REPO / folder)
    path = tmp_path / "experiments" / "example.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(yaml.safe_load(example) | yaml.safe_load(snippet)))
    loaded = load_experiment(str(path))
    check_experiment(loaded)
    trainings = {(run.label, str(member.experiment.section("train").overrides(run, member.experiment.data)))
                 for member in expand(loaded) for run in member.experiment.section("train").methods}
    assert sorted(label for label, _ in trainings) == ["simclr"] * 3 + ["xclr"] * 6


def test_every_published_report_is_listed_with_its_command_and_opens_a_section_with_verdicts():
    index = (DOCS / "benchmarks.md").read_text()
    for report in sorted((REPO / "benchmarks").glob("REPORT_*.md")):
        assert re.search(rf"^\| `{re.escape(report.name)}` \| `python benchmarks/", index, re.M), \
            f"docs/benchmarks.md's report table lacks {report.name} and its command"
        assert re.search(r"^#+ Verdicts\n(.*\n){0,4}\| claim \| whose \| measure \|", report.read_text(), re.M), \
            f"{report.name} has no verdict table"
