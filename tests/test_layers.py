"""The package's layers, as the development guide draws them: every module is in the picture, no import
runs up a layer (lazy imports and type-checking imports included) and no imports go round in a circle."""

import ast
import os
import re

import pytest

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "guides", "development.md")
LABEL_WIDTH = 17  # the picture's first column: the layer's name


def _modules() -> dict[str, str]:
    """Every module of the package by dotted name (a package by its own name), with its file."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "estimax")):
        for file in files:
            if file.endswith(".py"):
                name = os.path.relpath(os.path.join(folder, file), ROOT)[: -len(".py")].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = os.path.join(folder, file)
    return found


def _layers() -> list[tuple[str, list[str]]]:
    """The picture's layers, top first, each with its entries."""
    text = open(GUIDE).read()
    picture = text[text.index("## The layers") :].split("```\n")[1]
    layers: list[tuple[str, str]] = []
    for line in picture.splitlines():
        label, entries = line[:LABEL_WIDTH].strip(), line[LABEL_WIDTH:]
        if label and label != "|":
            layers.append((label, entries))
        elif layers and entries.strip():
            layers[-1] = (layers[-1][0], layers[-1][1] + " " + entries)
    parsed = []
    for label, entries in layers:
        entries = re.sub(r"\([^)]*\)", "", entries)  # comments
        entries = re.sub(r"\{([^}]*)\}", lambda m: "{" + m[1].replace(",", ";") + "}", entries)
        parsed.append((label, [e.strip() for e in entries.split(",") if e.strip()]))
    return parsed


def _placement(modules) -> tuple[dict[str, int], list[str]]:
    """Each module's layer (0 the top) and the picture's entries that name no module."""
    explicit, wings, unknown = {}, {}, []
    for depth, (_, entries) in enumerate(_layers()):
        for entry in entries:
            if entry == "estimax":
                explicit["estimax"] = depth
            elif entry.endswith("/"):
                wings[entry[:-1].replace("/", ".")] = depth
            elif m := re.fullmatch(r"(.*)/\{(.*)\}", entry):
                for name in m[2].split(";"):
                    explicit[f"estimax.{m[1].replace('/', '.')}.{name.strip()}"] = depth
            else:
                explicit["estimax." + entry.removesuffix(".py").replace("/", ".")] = depth
    unknown = [name for name in explicit if name not in modules]
    unknown += [wing for wing in wings if f"estimax.{wing}" not in modules]
    layer = {}
    for name in modules:
        if name in explicit:
            layer[name] = explicit[name]
            continue
        wing = name.removeprefix("estimax.")
        while wing and wing not in wings:
            wing = wing.rpartition(".")[0]
        if wing:
            layer[name] = wings[wing]
    return layer, unknown


def _imports(modules) -> dict[str, set[str]]:
    """Every module each module imports (any ``import`` statement anywhere in it)."""

    def target(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, file in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(open(file).read())):
            if isinstance(node, ast.Import):
                edges |= {target(alias.name) for alias in node.names if alias.name.split(".")[0] == "estimax"}
            elif (
                isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "estimax"
            ):
                edges |= {target(f"{node.module}.{alias.name}") for alias in node.names}
        graph[name] = edges - {name, ""}
    return graph


def test_every_module_is_in_the_picture_and_every_entry_is_a_module():
    modules = _modules()
    layer, unknown = _placement(modules)
    assert not unknown, f"the layers' picture names what is no module: {unknown}"
    missing = sorted(set(modules) - set(layer))
    assert not missing, f"modules missing from the layers' picture in {GUIDE}: {missing}"


def test_no_import_runs_up_a_layer():
    modules = _modules()
    layer, _ = _placement(modules)
    names = [label for label, _ in _layers()]
    upward = sorted(
        f"{source} ({names[layer[source]]}) imports {target} ({names[layer[target]]})"
        for source, targets in _imports(modules).items()
        for target in targets
        if source in layer and target in layer and layer[target] < layer[source]
    )
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_no_imports_go_round_in_a_circle():
    graph = _imports(_modules())
    # a package imports its own modules (re-exports), and they are its; a circle through the
    # package itself is not one
    circles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)
