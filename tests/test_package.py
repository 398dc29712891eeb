"""The package as pip installs it: `python -m estimax` is the `estimax` command, the wheel carries the
license, the type marker and the entry point, the `all` extra names every optional feature, and the
changelog has an entry for the current version."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

import estimax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _run(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout, not an installed estimax
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_python_m_estimax_is_the_estimax_command():
    for args, code in ((["--help"], 0), (["train", "--help"], 0), (["--version"], 0), (["train", "--seed", "x"], 2)):
        module, command = _run("-m", "estimax", *args), _run("-m", "estimax.cli", *args)
        assert (module.returncode, module.stdout, module.stderr) == (code, command.stdout, command.stderr), args
    help_text = _run("-m", "estimax", "--help").stdout
    assert help_text.startswith("usage: estimax [-h]") and "train" in help_text and "serve" in help_text


def test_the_all_extra_names_every_optional_feature():
    extras = _pyproject()["project"]["optional-dependencies"]
    (everything,) = extras["all"]
    named = set(re.fullmatch(r"estimax\[(.*)\]", everything).group(1).split(","))
    assert named == set(extras) - {"all", "test", "docs"}  # docs: the site's toolchain, no feature
    assert "estimax[docs]" in extras["test"]  # the tests build the site


def test_the_changelog_has_an_entry_for_the_current_version():
    text = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    versions = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d\d-\d\d))?$", text, re.MULTILINE)
    assert versions[0] == ("Unreleased", "")
    assert versions[1][0] == estimax.__version__ and versions[1][1], versions  # the newest release, dated


def test_the_wheel_carries_the_license_the_type_marker_and_the_command(tmp_path):
    setuptools = pytest.importorskip("setuptools", reason="building the wheel needs setuptools (the test extra)")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(
            f"setuptools {setuptools.__version__} predates license expressions (PEP 639); the test extra has 77+"
        )
    source = tmp_path / "src"  # a copy: the build leaves nothing in the checkout
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "tests", "benchmarks", "runs", "build", "*.egg-info")
    )
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp_path,
            source,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("estimax-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"estimax-{estimax.__version__}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert {"estimax/py.typed", "estimax/__main__.py", "estimax/data/arrayrecord.py", "estimax/data/hf.py"} <= names
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "License-Expression: Apache-2.0" in metadata
    for extra in ("hf", "all", "gcs"):
        assert f"Provides-Extra: {extra}" in metadata
    assert re.search(r"Requires-Dist: datasets>=[\d.]+; extra == \"hf\"", metadata)
    assert "estimax = estimax.cli:main" in entry_points
