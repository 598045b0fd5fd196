"""report/REPORT.md is exactly what report/build_report.py makes of the JSON kept under report/."""
import importlib.util
import json
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
    for path in [*module.SOURCES.values(), *module.TRACES.values()]:
        assert (REPORT / path).is_file() and f"`{path}`" in report


def test_every_result_was_made_by_one_version_of_the_script():
    module = build_report()
    versions = {name: run["script_sha256"] for name, run in module.load().items()}
    assert len(set(versions.values())) == 1, versions


def test_budget_section_and_figure_build_from_the_stored_sweep(tmp_path):
    """The budget section (issue 13), not yet in REPORT.md, builds from the sweep kept in report/results/budget/."""
    module = build_report()
    runs = {name: json.loads((REPORT / path.replace("results/", "results/budget/")).read_text())
            for name, path in module.BUDGET_SOURCES.items()}
    text = "\n".join(module.budget_section(runs))
    assert "| overlapped, `--max-gpu-memory 11` |" in text and "x the all-streamed one's" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 1 + 2 + len(module.BUDGETS)  # header, the ends, the caps
    pytest.importorskip("matplotlib")
    module.budget_figure(runs, tmp_path / "budget.png")
    assert (tmp_path / "budget.png").stat().st_size > 0
