"""report/REPORT.md is exactly what report/build_report.py makes of the JSON kept under report/."""
import importlib.util
from pathlib import Path

import pytest

REPORT = Path(__file__).resolve().parents[1] / "report"


def build_report():
    spec = importlib.util.spec_from_file_location("build_report", REPORT / "build_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_is_rebuilt_exactly_from_the_json():
    assert build_report().main(["--check"]) == 0, "run python3 report/build_report.py"


def test_report_cites_every_json_it_reads():
    report = (REPORT / "REPORT.md").read_text()
    module = build_report()
    for path in [*module.SOURCES.values(), *module.BUDGET_SOURCES.values(), *module.TRACES.values()]:
        assert (REPORT / path).is_file() and f"`{path}`" in report


@pytest.mark.parametrize("group", ["SOURCES", "BUDGET_SOURCES"])
def test_each_group_of_results_was_made_by_one_version_of_the_script(group):
    module = build_report()
    versions = {name: run["script_sha256"] for name, run in module.load(getattr(module, group)).items()}
    assert len(set(versions.values())) == 1, versions


def test_the_budget_section_names_the_version_that_made_it():
    module = build_report()
    budget = module.load(module.BUDGET_SOURCES)
    text = "\n".join(module.budget_section(budget, "f" * 64))
    assert f"sha256 `{budget['budget_ends']['script_sha256'][:12]}`, a later version than the runs above" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == (1 + 2 + len(module.BUDGETS)) + (1 + module.PAIRS)  # header, ends and caps; header and pairs


def test_budget_figure_builds_from_the_stored_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    module = build_report()
    module.budget_figure(module.load(module.BUDGET_SOURCES), tmp_path / "budget.png")
    assert (tmp_path / "budget.png").stat().st_size > 0
