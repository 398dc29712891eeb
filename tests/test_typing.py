"""The type check (mypy, configured by ``[tool.mypy]`` in pyproject.toml): the entry points, the inputs
(estimax/data) and a user's program written against the public API check cleanly, and a type checker
sees every public name of estimax, estimax.data, estimax.metrics and estimax.models with its type."""

import os
import re
import subprocess
import sys
import tomllib

import pytest

pytest.importorskip("mypy", reason="the type check needs mypy (pip install '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC_MODULES = ("estimax", "estimax.data", "estimax.metrics", "estimax.models")


def _public_names() -> list[str]:
    import importlib

    return [f"{m}.{name}" for m in PUBLIC_MODULES for name in importlib.import_module(m).__all__]


def test_the_package_and_its_public_api_type_check(tmp_path):
    names = _public_names()
    probe = tmp_path / "public_names.py"  # one reveal_type per public name: line i + 3 is names[i]
    probe.write_text("\n".join(["import " + ", ".join(PUBLIC_MODULES), ""] + [f"reveal_type({n})" for n in names]))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        targets = tomllib.load(f)["tool"]["mypy"]["files"]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", *targets, str(probe)],  # the cache (.mypy_cache) makes reruns fast
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not errors, "\n".join(errors)
    assert result.returncode == 0, result.stdout + result.stderr
    revealed = dict(re.findall(r"public_names\.py:(\d+): note: Revealed type is \"(.*)\"", result.stdout))
    assert len(revealed) == len(names), result.stdout
    unseen = [name for i, name in enumerate(names) if revealed[str(i + 3)] == "Any"]
    assert not unseen, (
        f"{unseen} reach a type checker as Any; expected their types. Fix: import them under "
        "`if TYPE_CHECKING:` in their package's __init__.py (`from module import Name as Name`)."
    )
