"""The template's test modules share their helpers through helper modules (conftest.py,
sessions.py, training.py, ...), never through each other: importing a test module runs
its module-level setup and puts its tests' names in the importer's namespace, and a
helper kept in one test file is found only by reading that file."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imports_of_test_modules(folder: Path) -> list[str]:
    """Each import, at any depth, by a module of ``folder`` of one of its ``test_*.py``
    modules: ``file:line imports test_x``."""
    test_modules = {path.stem for path in folder.glob("test_*.py")}
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.extend(
                f"{path.name}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] in test_modules
            )
    return found


def test_no_module_imports_a_test_module():
    found = imports_of_test_modules(TESTS)
    assert not found, "\n".join([*found, "move what they share to a helper module"])


def test_an_import_of_a_test_module_is_found_at_any_depth(tmp_path: Path):
    (tmp_path / "helpers.py").write_text("import json\n")
    (tmp_path / "test_a.py").write_text("from helpers import json\n\nTRAIN = 'x.train'\n")
    (tmp_path / "test_b.py").write_text(
        textwrap.dedent(
            """\
            import helpers
            from test_a import TRAIN


            def test_b():
                import test_a.sub as a
            """
        )
    )
    assert imports_of_test_modules(tmp_path) == [
        "test_b.py:2 imports test_a",
        "test_b.py:6 imports test_a.sub",
    ]
