"""The package's shape: one installed import name, and layers that import only downward.

    mmpipe.schemas           contracts (events, work items, results, settings)
    mmpipe.streams           runtime (topics, topology, broker, Kafka clients, batching, stage runtime)
    mmpipe.models, mmpipe.stages (with the sink's store)
    mmpipe.*                 api and operator tools (cli, supervisor, report, harness)

The import graph is read from the source with `ast` (function-level imports included), using
the same folder -> package mapping as pyproject.toml's package-dir.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

LAYERS = (
    ("mmpipe.schemas",),
    ("mmpipe.streams",),
    ("mmpipe.models", "mmpipe.stages"),
)
TOP = len(LAYERS)  # every other mmpipe module
HARNESS = "mmpipe.harness"


def source_modules() -> dict[str, Path]:
    """Module name -> file, for every module the wheel installs."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            # A folder mapped on its own (mmpipe.streams -> streams/) is not also under mmpipe/.
            modules.setdefault(name, path)
    return modules


def imports_of(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
    return {imp for imp in found if imp == "mmpipe" or imp.startswith("mmpipe.")}


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return TOP


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


GRAPH = {name: imports_of(name, path) for name, path in source_modules().items()}


def test_every_package_folder_maps_into_mmpipe():
    assert all(name == "mmpipe" or name.startswith("mmpipe.") for name in PACKAGE_DIRS)
    assert {"mmpipe.schemas", "mmpipe.streams", "mmpipe.models", "mmpipe.stages"} <= set(PACKAGE_DIRS)


def test_layers_import_only_downward():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_models_do_not_know_the_stages():
    wrong = [(m, t) for m, ts in GRAPH.items() if within(m, "mmpipe.models") for t in ts if within(t, "mmpipe.stages")]
    assert not wrong


def test_harnesses_are_reached_only_through_the_cli():
    """Benchmark, chaos and overload drivers need the [bench] extra: only the CLI (lazily, inside
    its commands) and the harness itself may import them."""
    wrong = [
        (m, t) for m, ts in GRAPH.items() for t in ts
        if within(t, HARNESS) and not within(m, HARNESS) and m != "mmpipe.cli"
    ]
    assert not wrong


def test_every_internal_import_names_a_real_module():
    modules = set(GRAPH)
    missing = [
        (m, t) for m, ts in GRAPH.items() for t in ts
        if t not in modules and t.rpartition(".")[0] not in modules  # `from pkg import name`
    ]
    assert not missing


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked tree, so no leftover build/ folder can leak into the wheel.
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    src = out / "src"
    for rel in filter(None, tracked.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (path,) = out.glob("mmpipe-*.whl")
    return path


def test_wheel_installs_exactly_one_top_level_package(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert top == {"mmpipe"}
    for module in ("mmpipe/streams/topology.py", "mmpipe/schemas/codec.py", "mmpipe/stages/decode/stage.py",
                   "mmpipe/stages/sink/store/sql.py", "mmpipe/models/base.py", "mmpipe/harness/bench/runner.py"):
        assert module in names


def test_harness_and_test_dependencies_are_extras_only(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    requires = meta.get_all("Requires-Dist") or []
    unconditional = {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
                     for r in requires if "extra ==" not in r}
    assert not unconditional & {"matplotlib", "psutil", "pytest", "hypothesis"}
    assert {"bench", "test"} <= set(meta.get_all("Provides-Extra") or [])
