"""The package as pip builds it: one wheel that carries the compiled core and the package's data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel .`` of this checkout, without its dependencies (the build is maturin's)."""
    if shutil.which("cargo") is None:
        pytest.fail("cargo is needed to build the package (make setup installs what it needs)")
    out = tmp_path_factory.mktemp("wheel")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, env=env, timeout=600)
    [built] = out.glob("ordering_layer-*.whl")
    return built


def test_the_wheel_carries_the_compiled_core_the_scripts_and_the_schemas(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert any(name.startswith("ordering_layer/_core.") and name.endswith(".so") for name in names)
    assert "ordering_layer/_core.pyi" in names and "ordering_layer/py.typed" in names
    tracked = subprocess.run(["git", "ls-files", "ordering_layer"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.split()
    data = {name for name in tracked if not name.endswith(".py")}
    assert data, "the package has data files (Lua scripts, Avro schemas, poms)"
    assert data <= names
    for schema in ("dead_letter", "schedule", "snapshot", "subscription"):
        assert f"ordering_layer/_schemas/{schema}.avsc" in names


def test_the_wheel_carries_no_reference_model_and_no_tests(wheel: Path) -> None:
    """The pure-Python model of the core lives in ``tests/model`` and is not shipped: the package's
    modules are only what the engine runs."""
    names = set(zipfile.ZipFile(wheel).namelist())
    model = {f"ordering_layer/subscriber/{name}.py" for name in ("partition", "key_queue", "recovery_walk",
                                                                  "commit_point")}
    assert not names & model
    assert not [name for name in names if name.startswith("tests/") or "/tests/" in name]
    assert "ordering_layer/subscriber/records.py" in names


def test_the_unpacked_wheel_imports_its_own_core(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    probe = ("import ordering_layer._core as core, ordering_layer.record as record, ordering_layer.subscriber;"
             "print(core.__file__); print(record._schema_path('schedule').is_file())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         check=True, capture_output=True, text=True, timeout=120).stdout.split()
    assert out[0].startswith(str(tmp_path)), out
    assert out[1] == "True"
