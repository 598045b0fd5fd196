"""The script as a text: every function, method and class says what it is for (the assignment asks for it)."""

import ast
import re
import textwrap

from helpers import SCRIPT


def unexplained(source: str) -> list[str]:
    """Functions, methods and classes (dunders aside) with neither a docstring nor a comment on or above their line."""
    lines = source.splitlines()
    bare = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("__"):
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        above = lines[first - 2].strip() if first > 1 else ""
        if not ast.get_docstring(node) and not above.startswith("#") and "#" not in lines[node.lineno - 1]:
            bare.append(f"{node.name} (line {node.lineno})")
    return bare


def test_every_function_and_class_is_explained():
    assert unexplained(SCRIPT.read_text()) == []


def test_the_check_finds_what_is_not_explained():
    source = '''
class A:
    """Explained."""
    def f(self): return 1
    # explained by a comment
    def g(self): return 2
    def h(self): ...  # explained on its line
    def __init__(self): ...
def bare(): return 3
'''
    assert sorted(unexplained(source)) == ["bare (line 9)", "f (line 4)"]


def long_definitions(source: str, class_lines: int = 150, function_lines: int = 40) -> list[str]:
    """Classes over `class_lines` lines and functions or methods over `function_lines`, docstrings included."""
    long = []
    for node in ast.walk(ast.parse(source)):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and lines > class_lines:
            long.append(f"class {node.name} ({lines} lines)")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > function_lines:
            long.append(f"{node.name} ({lines} lines)")
    return long


def test_classes_and_functions_stay_short():
    """No class over 150 lines, no function over 40."""
    assert long_definitions(SCRIPT.read_text()) == []


def test_the_length_check_counts_lines():
    source = "class A:\n" + "    x = 1\n" * 151 + "def f():\n" + "    y = 2\n" * 40
    assert long_definitions(source) == ["class A (152 lines)", "f (41 lines)"]


def sections(source: str) -> dict[str, int]:
    """Each section's title -> the line of its rule."""
    rules = re.compile(r"# -{10,} (.*)$")
    return {m.group(1): i + 1 for i, line in enumerate(source.splitlines()) if (m := rules.match(line))}


def test_the_map_at_the_top_gives_each_sections_line():
    """The module docstring's map: each section of the assignment on a row with its line and names defined in it,
    the line '# === Beyond the assignment ===' with its, and every later section with its line."""
    source = SCRIPT.read_text()
    lines, doc, rules = source.splitlines(), ast.get_docstring(ast.parse(source)), sections(source)
    mark = lines.index("# === Beyond the assignment ===") + 1
    rows = [re.match(r"\s+(\d+)  (\S.*?)(?:  +(.*))?$", row) for row in doc.splitlines() if re.match(r"\s+\d+  ", row)]
    core = {int(m.group(1)): m.group(3) for m in rows if "Beyond" not in m.group(2)}
    assert [m.group(1) for m in rows if "Beyond" in m.group(2)] == [str(mark)]
    assert sorted(core) == sorted(line for line in rules.values() if line < mark)
    defined = {n.name: n.lineno for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for line, names in core.items():
        end = min(rule for rule in [*rules.values(), mark] if rule > line)
        assert all(line < defined[name] < end for name in re.findall(r"[A-Za-z_]+(?=,|$)", names)), names
    beyond = " ".join(doc.split("# === Beyond the assignment ===", 1)[1].split())
    assert all(f" {line}" in beyond for title, line in rules.items() if line > mark), beyond


WAITS = re.compile(r"\.(wait_event|synchronize|wait)\(|\.get\(\)")  # a CUDA, thread or queue wait
ROW = re.compile(r"#   (S\d+) +(?:\[[\d ]*\] )?(.*)$")  # a sync table row's first line: its name, its lines, its text


def tagged_lines(source: str) -> dict[str, list[int]]:
    """Each sync row's name -> the lines of code whose comment names it (the table and comments alone aside)."""
    lines = {}
    for number, line in enumerate(source.splitlines(), 1):
        code, _, comment = line.partition("#")
        if code.strip():
            for name in dict.fromkeys(re.findall(r"\bS\d+\b", comment)):
                lines.setdefault(name, []).append(number)
    return lines


def renumbered(source: str) -> str:
    """`source` with each sync table row giving the lines that name it, and the map at the top each section's line.

    `python tests/test_source.py` writes it to the script, until it stands still (a row rewrapped moves the lines)."""
    lines = source.splitlines()
    tagged, out, i = tagged_lines(source), [], 0
    while i < len(lines):
        row = ROW.match(lines[i])
        if not row:
            out.append(lines[i])
            i += 1
            continue
        text = [row.group(2)]
        i += 1
        while i < len(lines) and lines[i].startswith("#        "):
            text.append(lines[i].strip("# "))
            i += 1
        where = "[" + " ".join(map(str, tagged.get(row.group(1), []))) + "] "
        first = f"#   {row.group(1):<4} "
        out += textwrap.wrap(where + " ".join(text), 120, initial_indent=first, subsequent_indent="#        ")
    text = "\n".join(out) + "\n"
    rules, mark = iter(sections(text).values()), text.splitlines().index("# === Beyond the assignment ===") + 1
    doc, end = text.splitlines(), text.index('"""', 3)
    in_map, beyond = True, False
    for k, line in enumerate(doc[: text[:end].count("\n")]):
        if beyond:  # the sections beyond the line, each with its line after its title
            doc[k] = re.sub(r"(?<= )\d{2,}(?=,|$)", lambda _: str(next(rules)), line)
        elif in_map and (row := re.match(r" +\d+  ", line)):
            beyond = "# === Beyond the assignment ===" in line
            doc[k] = f"{mark if beyond else next(rules):>7}  " + line[row.end() :]
    return "\n".join(doc) + "\n"


def test_the_sync_table_and_the_map_give_the_lines_they_name():
    """Each row of the sync table lists the lines whose code names it, and the map each section's line: both as
    renumbered writes them (run `python tests/test_source.py` after moving lines)."""
    source = SCRIPT.read_text()
    assert renumbered(source) == source, "line references are stale: run python tests/test_source.py"


def test_the_line_check_finds_a_moved_line():
    """A line added above the streamer moves every wait below it: the table and the map are then stale."""
    source = SCRIPT.read_text().replace("\nclass OneProcess:", "\n\nclass OneProcess:", 1)
    moved = renumbered(source)
    assert moved != source and renumbered(moved) == moved


def untagged_waits(source: str, first: str, last: str) -> tuple[list[str], set[str], set[str]]:
    """Between the section rules `first` and `last`: the waits that name no row of the sync table (S1, S2, ...); the
    rows the table holds; the rows the code names."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ----") and line.endswith(first))
    end = next(i for i, line in enumerate(lines) if line.startswith("# ----") and line.endswith(last))
    rows, named, untagged = set(), set(), []
    for number, line in enumerate(lines[start:end], start + 1):
        if line.startswith("#   S"):  # a row of the table
            rows.add(line.split()[1])
            continue
        code, _, comment = line.partition("#")
        tags = set(re.findall(r"\bS\d+\b", comment))
        named |= tags
        if WAITS.search(code) and not code.lstrip().startswith("def ") and not tags:
            untagged.append(f"line {number}: {line.strip()}")
    return untagged, rows, named


def test_every_wait_of_the_core_names_its_row_of_the_sync_table():
    """The table lists every synchronisation of the core and of the accelerations (at the top of the offload section);
    each CUDA, thread or queue wait from there to the end of the several-GPU section, and in running a mode (the
    steps' end), names its row, and each row is named."""
    source = SCRIPT.read_text()
    untagged, rows, named = untagged_waits(
        source, "blocked and overlapped offload", "a model from a folder, or drawn unit by unit"
    )
    steps_untagged, _, steps_named = untagged_waits(source, "running a mode", "the run")  # S11
    assert untagged == steps_untagged == []
    assert rows == named | steps_named and len(rows) >= 10


def test_the_sync_check_finds_an_untagged_wait():
    source = "# ---- a\n#   S1   x\nstream.wait_event(e)  # S1\ndone.wait()\nq.get()  # the queue\n# ---- b\n"
    untagged, rows, named = untagged_waits(source, "a", "b")
    assert untagged == ["line 4: done.wait()", "line 5: q.get()  # the queue"] and rows == named == {"S1"}


if __name__ == "__main__":  # renumber the script's sync table and map in place, until a pass changes nothing
    for _ in range(5):
        before = SCRIPT.read_text()
        after = renumbered(before)
        if after == before:
            break
        SCRIPT.write_text(after)
