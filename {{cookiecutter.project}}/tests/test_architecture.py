"""The shape of the package's code, and ARCHITECTURE.md kept true to it.

Each check module is imported in a fresh interpreter (a fork of one that has imported
torch alone): it may pull in torch and the shared floor (``testing.SHARED_FLOOR``),
never another check. The plugin module, which pytest loads in every run, must load
without torch, in a fresh interpreter of its own. ARCHITECTURE.md names every module
of the package (a package's modules in its own block) and lists every import from
``testing/`` outside it, each of a floor module.
"""

import ast
import json
import pkgutil
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import {{ cookiecutter.package }}
from {{ cookiecutter.package }} import testing

PACKAGE = testing.__name__
MODULES = sorted(module.name for module in pkgutil.iter_modules(testing.__path__))
CHECKS = [name for name in MODULES if name not in testing.SHARED_FLOOR and name != "plugin"]
SOURCE = Path({{ cookiecutter.package }}.__file__).parent
ARCHITECTURE = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"
# The fenced text blocks of ARCHITECTURE.md: the rooms drawn as a file tree.
TEXT_BLOCK = re.compile(r"^```text\n(.*?)^```", re.M | re.S)
# The header of the table that lists the imports from testing/ outside it.
IMPORTS_TABLE = "| module | imports | why |"
# The commands outside testing/ whose job is to run one check, with that check.
CHECK_RUNNERS = {("replay.py", "testing.finite_check")}


def named(text: str, file_name: str) -> bool:
    """Whether ``text`` names ``file_name`` (``train.py``, ``gradcheck/``) as a whole word."""
    return re.search(rf"(?<![\w/.]){re.escape(file_name)}(?![\w/])", text) is not None


def package_blocks(text: str) -> dict[str, str]:
    """The text blocks that draw a package's rooms, by the package's folder (``gradcheck/``)."""
    blocks = {}
    for block in TEXT_BLOCK.findall(text):
        first, _, rest = block.partition("\n")
        if re.fullmatch(r"[\w]+/", first.strip()) and first == first.lstrip():
            blocks[first.strip()] = rest
    return blocks


def rooms(folder: Path) -> list[tuple[str, Path]]:
    """Every module and package in ``folder``, as ARCHITECTURE.md names them."""
    found = []
    for module in pkgutil.iter_modules([str(folder)]):
        name = f"{module.name}/" if module.ispkg else f"{module.name}.py"
        found.append((name, folder / name))
    return sorted(found)


def test_architecture_names_every_module():
    text = ARCHITECTURE.read_text()
    blocks = package_blocks(text)
    missing = [
        str(path.relative_to(SOURCE))
        for folder in (SOURCE, SOURCE / "testing")
        for name, path in rooms(folder)
        if not named(text, name)
    ]
    for package, path in rooms(SOURCE / "testing"):
        if not package.endswith("/"):
            continue
        block = blocks.get(package, "")
        missing += [f"{package}{name}" for name, _ in rooms(path) if not named(block, name)]
        missing += [
            f"{package}{listed} (listed, but no such module)"
            for listed in re.findall(r"^\s+(\w+\.py)\b", block, re.M)
            if listed != "__init__.py" and not (path / listed).is_file()
        ]
    assert not missing, (
        f"ARCHITECTURE.md does not match the modules of {SOURCE}: {', '.join(missing)}. Name "
        "each module where it belongs (the rooms, the floor table, the checks table), and "
        "the modules of a package in a text block that starts with its folder (gradcheck/)"
    )


def imports_from_testing() -> set[tuple[str, str]]:
    """(module, testing module it imports) for every module of the package outside testing/."""
    top = PACKAGE.rpartition(".")[0]
    found = set()
    for path in sorted(SOURCE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (
                    node.module if node.level == 0 else ".".join(filter(None, [top, node.module]))
                )
                modules = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for module in modules:
                if module.startswith(f"{PACKAGE}."):
                    found.add(
                        (path.name, "testing." + module.removeprefix(PACKAGE + ".").split(".")[0])
                    )
    return found


def listed_imports(text: str) -> set[tuple[str, str]]:
    """The rows of ARCHITECTURE.md's table of imports from testing/ outside it."""
    _, found, table = text.partition(IMPORTS_TABLE)
    assert found, f"ARCHITECTURE.md has no table headed {IMPORTS_TABLE!r}"
    rows = set()
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        module, imported = (cell.strip().strip("`") for cell in line.split("|")[1:3])
        rows.add((module, imported))
    return rows


def test_architecture_lists_every_import_from_testing_outside_it():
    actual = imports_from_testing()
    listed = listed_imports(ARCHITECTURE.read_text())
    assert actual == listed, (
        "ARCHITECTURE.md's imports from testing/ outside it are not the package's: "
        f"not listed: {sorted(actual - listed)}, listed but not imported: "
        f"{sorted(listed - actual)}"
    )
    not_floor = sorted(
        (module, imported)
        for module, imported in actual - CHECK_RUNNERS
        if imported.removeprefix("testing.") not in testing.SHARED_FLOOR
    )
    assert not not_floor, (
        f"{not_floor}: outside testing/ a module imports only the shared floor "
        "(testing.SHARED_FLOOR), never a check or the plugin; only a command that runs "
        f"one check imports it ({sorted(CHECK_RUNNERS)})"
    )


def modules_loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``statement``."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{statement!r} failed:\n{result.stderr}"
    return set(result.stdout.split())


def test_the_package_holds_checks():
    assert "gradcheck" in CHECKS
    assert "calls" not in CHECKS


# Each check imported in its own fork of one fresh interpreter that has imported only
# torch (every check imports it; it imports nothing of this package): what a fresh
# interpreter loads for the check, without paying torch's import (seconds) per check.
# Each child prints its check and the package's modules it loaded, as one JSON line.
EACH_CHECK_IN_A_FORK = """
import importlib, json, os, sys, warnings
import torch
package, *checks = sys.argv[1:]
for check in checks:
    with warnings.catch_warnings():  # Python 3.12 warns about fork() with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:
        importlib.import_module(f"{package}.{check}")
        loaded = [name for name in sys.modules if name.startswith(f"{package}.")]
        print(json.dumps([check, loaded]), flush=True)
        os._exit(0)
    os.waitpid(child, 0)
"""


@dataclass(frozen=True)
class ChecksImported:
    """The package's modules that importing each check loaded; a check whose import
    failed is missing, and its traceback is in ``stderr``."""

    loaded: dict[str, set[str]]
    stderr: str


@pytest.fixture(scope="module")
def checks_imported() -> ChecksImported:
    result = subprocess.run(
        [sys.executable, "-c", EACH_CHECK_IN_A_FORK, PACKAGE, *CHECKS],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = map(json.loads, result.stdout.splitlines())
    return ChecksImported({check: set(loaded) for check, loaded in lines}, result.stderr)


@pytest.mark.parametrize("check", CHECKS)
def test_a_check_imports_no_other_check(checks_imported, check):
    loaded = checks_imported.loaded.get(check)
    assert loaded is not None, f"importing {PACKAGE}.{check} failed:\n{checks_imported.stderr}"
    others = [name for name in CHECKS if name != check and f"{PACKAGE}.{name}" in loaded]
    assert not others, (
        f"importing {PACKAGE}.{check} imports the check module(s) {', '.join(others)}: checks "
        "import only the shared floor (testing.SHARED_FLOOR) and never each other. Move what "
        "they share into a floor module (and list a new one in SHARED_FLOOR); see "
        "ARCHITECTURE.md"
    )


def test_the_plugin_loads_without_torch():
    loaded = modules_loaded_by(f"import {PACKAGE}.plugin")
    assert "torch" not in loaded, (
        f"importing {PACKAGE}.plugin imports torch: pytest loads the plugin in every run, so a "
        "check module must be imported inside the fixture that uses it"
    )


def test_no_two_classes_share_a_name():
    """One name per concept: ``Stopped`` in train.py and ``_Stopped`` in a check would be two
    things a reader takes for one (a leading underscore does not make another name)."""
    defined: dict[str, list[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                where = f"{path.relative_to(SOURCE)}:{node.lineno} {node.name}"
                defined.setdefault(node.name.lstrip("_"), []).append(where)
    shared = {name: places for name, places in defined.items() if len(places) > 1}
    assert not shared, "classes that share a name: " + "; ".join(
        ", ".join(places) for places in shared.values()
    )
