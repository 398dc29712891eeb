"""The documentation cannot rot: the site builds strictly, every public name has a
docstring (and a place in the API reference), and every ```python block of README.md
and docs/**/*.md runs.

Blocks run in order, page by page, in one namespace per page (a later block may use
an earlier one's names), with the working directory in a temporary folder (relative
paths such as ``runs/x`` land there). A block that cannot run here is preceded by
``<!-- no-run: REASON -->`` (invisible on GitHub and on the site; the reason is
required). Setup a page needs but does not show goes in a ```python block inside an
HTML comment that says so: ``<!-- hidden setup ... -->``; it runs like the others.
"""

import ast
import functools
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
API_MODULES = ("estimax", "estimax.data", "estimax.metrics", "estimax.models", "estimax.serving")
API_MODULES += ("estimax.distributed", "estimax.trackers", "estimax.cli.task", "estimax.errors")
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>\S.*?)\s*-->\s*$")


def python_blocks(text: str):
    """(line, code, no-run reason or None) of each ```python block, in order."""
    for match in FENCE.finditer(text):
        if match["info"].strip().split(" ")[0] != "python":
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        no_run = NO_RUN.search(before)
        code = "\n".join(ln[len(match["indent"]) :] for ln in match["code"].splitlines())
        yield line, code, no_run["reason"] if no_run else None


def public_names():
    """(module, name) of every public name: a module's ``__all__``, else what it defines."""
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        if hasattr(module, "__all__"):
            names = list(module.__all__)
        else:
            names = [n for n, value in vars(module).items() if not n.startswith("_") and _defined_in(value, n, module)]
        for name in names:
            yield module, name


def _defined_in(value, name: str, module) -> bool:
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__module__ == module.__name__
    return name.isupper() and name in _assigned(module)  # constants assigned in this module


@functools.cache
def _assigned(module) -> dict[str, str | None]:
    """Names assigned at module level in ``module``'s source -> their attribute docstring (the
    string literal right after the assignment, which mkdocstrings shows), or None."""
    body = ast.parse(inspect.getsource(module)).body
    found = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        doc = None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = after.value.value
        for target in targets:
            if isinstance(target, ast.Name):
                found[target.id] = doc
    return found


def docstring(module, name: str) -> str | None:
    value = getattr(module, name)
    if inspect.isclass(value):  # its own, not a base class's nor the one dataclasses generate
        doc = value.__dict__.get("__doc__")
        return None if not doc or doc.startswith(f"{value.__name__}(") else doc
    if inspect.ismodule(value) or inspect.isfunction(value):
        return inspect.getdoc(value)
    # a constant: its docstring is where it is assigned, in this module or the one it is imported from
    homes = [m for n, m in list(sys.modules.items()) if n.startswith("estimax.") and getattr(m, name, None) is value]
    for candidate in (module, *homes):
        doc = _assigned(candidate).get(name)
        if doc:
            return doc
    return None


def test_every_public_name_has_a_docstring():
    missing = [
        f"{module.__name__}.{name}" for module, name in public_names() if not (docstring(module, name) or "").strip()
    ]
    assert not missing, (
        f"public names without a docstring: {', '.join(missing)}. Fix: add one (the API reference shows it)"
    )


def test_site_builds_strictly_with_every_public_name(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install '.[test]')")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    anchors = set()
    for page in (site / "api").rglob("index.html"):
        anchors.update(re.findall(r'id="(estimax[\w.]*)"', page.read_text()))
    undocumented = [
        f"{module.__name__}.{name}"
        for module, name in public_names()
        if not anchors & set(_homes(module, name)) and not inspect.ismodule(getattr(module, name))
    ]
    assert not undocumented, f"public names missing from docs/api/*.md: {', '.join(undocumented)}. Fix: add a ::: entry"


def _homes(module, name: str) -> list[str]:
    """Where ``module.name`` may be documented: there, or under each API module that has the same
    object as a public name (``estimax.ConfigError`` is documented as ``estimax.errors.ConfigError``)."""
    value = getattr(module, name)
    others = [m for m, n in public_names() if n == name and m is not module and getattr(m, n) is value]
    return [f"{m.__name__}.{name}" for m in (module, *others)]


def test_pages_are_found_and_blocks_parse():
    blocks = [(page, line, code) for page in PAGES for line, code, _ in python_blocks(page.read_text())]
    assert len(PAGES) > 20 and len(blocks) > 20, (len(PAGES), len(blocks))
    for page, line, code in blocks:
        compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")  # marked blocks too: no syntax rot


@pytest.mark.parametrize(
    "page", [p for p in PAGES if "```python" in p.read_text()], ids=lambda p: str(p.relative_to(ROOT))
)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    ran = 0
    for line, code, no_run in python_blocks(page.read_text()):
        if no_run:
            continue
        where = f"{page.relative_to(ROOT)}:{line}"
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"the ```python block at {where} failed: {type(error).__name__}: {error}") from error
        ran += 1
    if ran == 0:
        pytest.skip("every block on this page is marked no-run")


def test_cli_help_points_to_existing_pages():
    done = subprocess.run(
        [sys.executable, "-m", "estimax", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    pages = re.findall(r"docs/[\w/.-]+\.md", done.stdout.replace("\n", " "))
    assert done.returncode == 0 and pages, done.stdout + done.stderr
    assert all((ROOT / page).is_file() for page in pages), pages
