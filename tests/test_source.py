"""The script as a text: every function, method and class says what it is for (the assignment asks for it)."""

import ast

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
