"""The house stays in order: no class in echo2cli over 270 lines, no function over 60 (counted as formatted).

Classes near the limit: `learner.coordinator.Coordinator`, the locked facade over the learner's parts, and
`learner.loop.Learner`, which wires a run's components; everything with logic of its own lives in the parts."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "echo2cli"
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 270, 60


def sizes(kind: type) -> dict[str, int]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                out[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_class_is_longer_than_the_limit():
    long = {name: n for name, n in sizes(ast.ClassDef).items() if n > MAX_CLASS_LINES}
    assert not long, long


def test_no_function_is_longer_than_the_limit():
    functions = sizes(ast.FunctionDef) | sizes(ast.AsyncFunctionDef)
    long = {name: n for name, n in functions.items() if n > MAX_FUNCTION_LINES}
    assert not long, long
