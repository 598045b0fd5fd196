"""report/REPORT.md is exactly what report/build_report.py makes of the JSON kept under report/."""
import importlib.util
from pathlib import Path

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
