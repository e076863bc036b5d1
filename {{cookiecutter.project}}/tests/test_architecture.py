"""The shape of the bundled plugin's code (ARCHITECTURE.md): checks side by side on one floor.

Each check module is imported in a fresh interpreter: it may pull in torch and the
shared floor (``testing.SHARED_FLOOR``), never another check. The plugin module, which
pytest loads in every run, must load without torch.
"""

import pkgutil
import subprocess
import sys

import pytest

from {{ cookiecutter.package }} import testing

PACKAGE = testing.__name__
MODULES = sorted(module.name for module in pkgutil.iter_modules(testing.__path__))
CHECKS = [name for name in MODULES if name not in testing.SHARED_FLOOR and name != "plugin"]


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


@pytest.mark.parametrize("check", CHECKS)
def test_a_check_imports_no_other_check(check):
    loaded = modules_loaded_by(f"import {PACKAGE}.{check}")
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
