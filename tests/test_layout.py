"""The package's shape: layers held by import-linter, every package shipped, old paths kept,
module sizes bounded, and one consistent PySpark installed."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "airflow_broker"
#: A module longer than this says in its docstring why it is one module.
MAX_LINES = 600
WHY_MARKER = "One module because"


def test_import_contracts_hold() -> None:
    """The contracts in pyproject.toml: the layers, the forbidden ones (shared leaves import no
    layer; nothing but the Airflow glue imports airflow; a package's modules do not import
    the package's own ``__init__``) and the acyclic one."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_layer_violation_breaks_the_contract(tmp_path: Path) -> None:
    """The contract can fail: in a copy of the package, a storage module importing the facade
    is reported."""
    copy = tmp_path / "airflow_broker"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "storage" / "probe.py").write_text("from airflow_broker.broker import Broker\n")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = "\n    ".join(config["contracts"][0]["layers"])
    ini = tmp_path / "contracts.ini"
    ini.write_text(
        "[importlinter]\nroot_package = airflow_broker\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        f"containers = airflow_broker\nlayers =\n    {layers}\n"
    )
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--no-cache", "--config", str(ini)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0, done.stdout
    assert "airflow_broker.storage is not allowed to import airflow_broker.broker" in " ".join(
        done.stdout.split()
    )


def _package_cycles(package: Path, name: str) -> list[str]:
    """Each ``from P import ...`` (names or submodules) in a module of package P whose
    ``__init__`` imports that module, directly or through others: a cycle through P's
    ``__init__``, which import-linter's graph does not show when what is imported is a
    submodule."""
    import grimp

    graph = grimp.build_graph(name, cache_dir=None, exclude_type_checking_imports=True)
    packages = {
        ".".join((name, *init.parent.relative_to(package).parts))
        for init in package.rglob("__init__.py")
    }
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        module = ".".join((name, *path.with_suffix("").relative_to(package).parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            owner = node.module
            inside = owner in packages and module.startswith(owner + ".")
            if inside and graph.find_shortest_chain(importer=owner, imported=module):
                found.append(f"{module}:{node.lineno}: from {owner} import ...")
    return found


def test_no_module_imports_the_package_init_that_imports_it() -> None:
    assert _package_cycles(PACKAGE, "airflow_broker") == []


def test_a_cycle_through_a_package_init_is_reported(tmp_path: Path) -> None:
    """The check can fail: a module of a package whose ``__init__`` imports it, taking a
    sibling through that ``__init__``."""
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from probe_pkg.a import A\n")
    (pkg / "a.py").write_text("from probe_pkg import b\n\nA = b.B\n")
    (pkg / "b.py").write_text("B = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert _package_cycles(pkg, "probe_pkg") == ["probe_pkg.a:1: from probe_pkg import ..."]
    finally:
        sys.path.remove(str(tmp_path))
        for mod in [m for m in sys.modules if m.split(".")[0] == "probe_pkg"]:
            del sys.modules[mod]


def test_every_package_directory_is_shipped() -> None:
    """pyproject lists packages explicitly (hooks/, operators/, sensors/ are mapped into the
    namespace): a new subpackage that is not listed would be missing from the wheel."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found - listed == set()


def _module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_modules_stay_small_or_say_why() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        lines = path.read_text().count("\n")
        if lines > MAX_LINES and WHY_MARKER not in _module_docstring(path):
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert too_long == []


def _unlisted_modules(package: Path, layout: str) -> list[str]:
    """Modules and subpackages of ``package`` that the layout block does not name."""
    missing = []
    for path in sorted(package.rglob("*.py")):
        if "versions" in path.parts or "__pycache__" in path.parts:
            continue  # migrations are listed as a folder
        if path.name == "__init__.py":
            if path.parent != package and not re.search(rf"\b{path.parent.name}/", layout):
                missing.append(f"{path.parent.relative_to(package.parent)}/")
        elif not re.search(rf"\b{re.escape(path.stem)}\b", layout):
            missing.append(str(path.relative_to(package.parent)))
    return missing


def test_the_architecture_page_lists_every_module(tmp_path: Path) -> None:
    """docs/architecture.md's layout names every module and subpackage of the engine; a new
    one that it does not name is reported."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page.split("## Layout", 1)[1].split("```", 2)[1]
    assert _unlisted_modules(PACKAGE, layout) == []
    probe = tmp_path / "airflow_broker"
    (probe / "transport").mkdir(parents=True)
    (probe / "transport" / "__init__.py").write_text("")
    (probe / "transport" / "unheard_of.py").write_text("")
    assert _unlisted_modules(probe, layout) == ["airflow_broker/transport/unheard_of.py"]


def test_every_layer_says_its_job() -> None:
    for layer in ("storage", "routing", "messaging", "transport", "operations", "activation"):
        assert len(_module_docstring(PACKAGE / layer / "__init__.py")) > 100, layer
    assert "only" in _module_docstring(PACKAGE / "provider" / "__init__.py").lower()


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        (
            "airflow_broker.triggers.activation",
            "airflow_broker.provider.triggers.activation",
            "QueueActivationTrigger",
        ),
        (
            "airflow_broker.triggers.conversation",
            "airflow_broker.provider.triggers.conversation",
            "ConversationMessageTrigger",
        ),
        ("airflow_broker.dbmanager", "airflow_broker.provider.dbmanager", "BrokerDBManager"),
        ("airflow_broker.runner", "airflow_broker.activation.runner", "ActivationRunner"),
        ("airflow_broker.monitoring", "airflow_broker.operations.monitoring", "queues"),
        ("airflow_broker.schema", "airflow_broker.storage.schema", "message"),
    ],
)
def test_old_paths_still_import_the_same_objects(old: str, new: str, name: str) -> None:
    """Serialized triggers name their classpath; airflow.cfg names the DB manager; user code
    imports the flat layout's modules. Each old path gives the very same object, with a
    DeprecationWarning, and the module keeps its new identity."""
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)
    real = importlib.import_module(new)
    assert moved is real
    assert getattr(moved, name) is getattr(real, name)
    assert real.__spec__ is not None
    assert real.__spec__.name == new


def test_a_stored_trigger_classpath_of_the_flat_layout_loads() -> None:
    """What Airflow does with a trigger row written before the move."""
    from airflow.sdk.module_loading import import_string

    from airflow_broker.provider.triggers.activation import QueueActivationTrigger

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = import_string("airflow_broker.triggers.activation.QueueActivationTrigger")
    assert cls is QueueActivationTrigger


def _python(program: str) -> str:
    """What ``program`` prints, run by a fresh interpreter (which must succeed)."""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_engine_imports_without_airflow() -> None:
    """The engine, in a process where importing airflow fails."""
    program = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'airflow' or name.startswith('airflow.'):\n"
        "            raise ImportError('airflow is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import airflow_broker, airflow_broker.cli, airflow_broker.transport\n"
        "import airflow_broker.operations.monitoring, airflow_broker.examples.purchase_order\n"
        "b = airflow_broker.Broker.connect('sqlite://')\n"
        "b.migrate()\n"
        "print('ok', 'airflow' in sys.modules)\n"
    )
    assert _python(program) == "ok False"


def test_the_provider_entry_point_does_not_load_the_engine() -> None:
    """Airflow calls ``airflow_broker.provider.get_provider_info`` in every process that reads its
    configuration (each ``airflow`` command, the scheduler, each DAG processor): that import
    must not load the engine. The public names still come from the package, on first use."""
    program = (
        "import sys\n"
        "from airflow_broker.provider import get_provider_info\n"
        "get_provider_info()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('airflow_broker'))\n"
        "print(loaded)\n"
        "from airflow_broker import Broker, Message, ERROR, __all__\n"
        "import airflow_broker\n"
        "assert all(getattr(airflow_broker, n) is not None for n in __all__)\n"
        "assert Broker.__module__ == 'airflow_broker.broker'\n"
        "print('ok')\n"
    )
    loaded, ok = _python(program).splitlines()
    assert loaded == str(
        [
            "airflow_broker",
            "airflow_broker._moved",
            "airflow_broker.provider",
            "airflow_broker.provider.info",
        ]
    )
    assert ok == "ok"
    import airflow_broker

    with pytest.raises(AttributeError, match="has no attribute 'Brokr'"):
        airflow_broker.Brokr  # noqa: B018


def _jar_version() -> str:
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    cores = sorted(jars.glob("spark-core_*.jar"))
    assert cores, f"no spark-core jar in {jars}: pyspark is installed without its jars"
    match = re.fullmatch(r"spark-core_[0-9.]+-(.+)\.jar", cores[0].name)
    assert match, cores[0].name
    return match.group(1)


def test_pyspark_python_files_and_jars_are_one_release() -> None:
    """pyspark and pyspark-client both install the `pyspark` package; if an installer wrote the
    client's Python files of another release over pyspark's, the job would call JVM constructors
    that do not exist (the first Python UDF fails)."""
    import pyspark

    assert pyspark.__version__ == _jar_version(), (
        f"pyspark's Python files are {pyspark.__version__} but its jars are {_jar_version()}: "
        "pin pyspark and pyspark-client to the same release"
    )


def test_the_spark_tasks_queue_columns_are_the_engines() -> None:
    """direct_task is shipped to Spark's executors by value and may not import the engine: its
    copy of the queue's insert columns must stay the engine's."""
    from airflow_broker.messaging.rows import QUEUE_INSERT_COLUMNS
    from airflow_broker.spark import direct_task

    assert direct_task._QUEUE_COLUMNS == QUEUE_INSERT_COLUMNS
