"""The package's size rules: no module over 400 lines, no signature over 7 parameters.

Parameters are counted as a reader counts them: every one but ``self``/``cls``, keyword-only ones
included, ``*args`` and ``**kwargs`` one each. A module or a function that breaks a rule for now is
named below with its reason; one that no longer breaks it fails too, so that the list only shrinks.
"""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.quick

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "estimax"
MAX_LINES = 400
MAX_PARAMETERS = 7

LONG_MODULES: dict[str, str] = {}  # a module over the limit, and why, while it is being split
LONG_SIGNATURES: dict[str, int] = {}  # a function over the limit, and how many it takes, while it is being split


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _parameters(args: ast.arguments) -> int:
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (bool(names) and names[0] in ("self", "cls"))


def _signatures(tree: ast.AST, prefix: str = ""):
    """``(qualified name, parameters)`` of every function, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, _parameters(node.args)
            yield from _signatures(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _signatures(node, f"{prefix}{node.name}.")
        else:
            yield from _signatures(node, prefix)


def test_no_module_has_over_400_lines():
    lengths = {_name(p): len(p.read_text().splitlines()) for p in _modules()}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in LONG_MODULES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}; split each along a seam"
    stale = sorted(name for name in LONG_MODULES if lengths.get(name, 0) <= MAX_LINES)
    assert not stale, f"{stale} are no longer over {MAX_LINES} lines: take them out of LONG_MODULES"


def test_no_signature_has_over_7_parameters():
    found = {
        f"{_name(p)}:{name}": count
        for p in _modules()
        for name, count in _signatures(ast.parse(p.read_text()))
        if count > MAX_PARAMETERS
    }
    unexpected = {name: n for name, n in found.items() if LONG_SIGNATURES.get(name) != n}
    assert not unexpected, (
        f"signatures over {MAX_PARAMETERS} parameters: {unexpected}; group the ones that travel together "
        "into a frozen dataclass"
    )
    stale = sorted(set(LONG_SIGNATURES) - set(found))
    assert not stale, f"{stale} take at most {MAX_PARAMETERS} parameters now: take them out of LONG_SIGNATURES"
