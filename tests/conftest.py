import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def memory_runs(request, tmp_path_factory):
    """The command lines the GPU tests judge on memory alone (each collected module's MEMORY_RUNS: name -> flags), run
    side by side the first time a test asks for them: name -> (the process, the path of its JSON)."""
    from helpers import cli_all

    commands = {}
    for module in dict.fromkeys(item.module for item in request.session.items):
        commands |= getattr(module, "MEMORY_RUNS", {})
    folder = tmp_path_factory.mktemp("memory_runs")
    paths = {name: folder / f"{i}.json" for i, name in enumerate(commands)}
    done = cli_all({name: [*flags, "--json", paths[name]] for name, flags in commands.items()}, workers=6)
    return {name: (done[name], paths[name]) for name in commands}
