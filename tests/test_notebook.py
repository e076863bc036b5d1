"""The generated ``notebooks/quickstart.ipynb``, executed headless the way Jupyter runs it.

nbclient starts a real IPython kernel (ipykernel, this test run's Python) in the
notebook's folder, with the generated project's ``src`` importable, and runs every
cell in order; matplotlib draws through the kernel's inline backend, as in JupyterLab.
"""

from __future__ import annotations

import csv
import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path("notebooks", "quickstart.ipynb")


@pytest.fixture(scope="module")
def executed(default_project: Path, tmp_path_factory: pytest.TempPathFactory):
    """The default project's notebook after a headless run of all its cells."""
    project = tmp_path_factory.mktemp("notebook") / "project"
    project.mkdir()
    source = default_project / NOTEBOOK
    (project / "notebooks").mkdir()
    (project / NOTEBOOK).write_bytes(source.read_bytes())
    notebook = nbformat.read(project / NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(default_project / "src"))
        client = NotebookClient(
            notebook,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(project / "notebooks")}},
        )
        client.execute()
    return project, notebook


def outputs(notebook, output_type: str) -> list:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == output_type
    ]


def text_of(notebook) -> str:
    return "".join(output.text for output in outputs(notebook, "stream"))


def test_generated_notebook_has_no_outputs(default_project: Path) -> None:
    """As generated (and as nbstripout keeps it in git): no outputs, no execution counts."""
    cells = json.loads((default_project / NOTEBOOK).read_text())["cells"]
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert code
    assert all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code)


def test_notebook_runs_headless_and_draws_the_loss_curve(executed) -> None:
    project, notebook = executed
    assert outputs(notebook, "error") == []
    images = [output for output in outputs(notebook, "display_data") if "image/png" in output.data]
    assert len(images) == 1, "the loss curve was not drawn"
    (run,) = (project / "notebooks" / "runs").iterdir()
    assert run.name.startswith("quickstart-")
    with (run / "metrics.csv").open(newline="") as file:
        assert [row["epoch"] for row in csv.DictReader(file)] == ["1", "2", "3", "4", "5"]


def test_notebook_prints_inside_forward_and_runs_the_checks(executed) -> None:
    _, notebook = executed
    printed = text_of(notebook)
    assert "batch of 8: 0 block step(s)" in printed  # inputs scaled by 0.1: the loop is skipped
    assert "3 runs of forward and backward are bitwise equal" in printed
    assert "gradcheck GatedNet: first order passed" in printed
    assert "epoch 5/5 [########################]" in printed  # train's progress (stderr)


def test_breakpoint_is_shown_but_never_executed(default_project: Path) -> None:
    """A ``breakpoint()`` that ran headless would wait for a debugger prompt nobody answers."""
    notebook = nbformat.read(default_project / NOTEBOOK, as_version=4)
    lines = [
        line.strip()
        for cell in notebook.cells
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if "breakpoint()" in line
    ]
    assert lines
    assert all(line.startswith("#") for line in lines)


def readme_notebook_line(project: Path) -> str:
    """The one line the generated README gives to run the notebook outside the container."""
    readme = (project / "README.md").read_text()
    section = readme.split("The quickstart notebook, outside the container", 1)[1]
    (line,) = section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    return line


@pytest.mark.slow
def test_readme_line_runs_the_notebook_outside_the_container(bake, project_env) -> None:
    """The README's line, typed in a fresh environment: pip installs the ``notebook`` extra
    and ``jupyter execute`` runs every cell in a kernel of that environment's Python."""
    project = bake()
    line = readme_notebook_line(project)
    assert line == 'pip install -e ".[notebook]" && jupyter execute notebooks/quickstart.ipynb'
    # project_env sees this test run's packages through a .pth file, but not their
    # scripts: pip, jupyter and jupyter-execute of its own (these versions, no
    # dependencies) make the line install into it and start the kernel with its Python.
    scripts = [f"{name}=={version(name)}" for name in ("pip", "jupyter-core", "nbclient")]
    project_env.run("pip", "install", "--quiet", "--no-deps", "--ignore-installed", *scripts,
                    cwd=project)  # fmt: skip
    result = subprocess.run(
        ["bash", "-c", line],
        cwd=project,
        env=project_env.env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Executing notebooks/quickstart.ipynb" in result.stderr
    assert "does not provide the extra" not in result.stdout + result.stderr
    notebook_extra = subprocess.run(
        [str(project_env.python), "-c", "from importlib.metadata import requires; "
         "print([r for r in requires('dynamic-model') if 'notebook' in r])"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "ipykernel" in notebook_extra
    assert "nbclient" in notebook_extra
    (run,) = (project / "notebooks" / "runs").iterdir()
    with (run / "metrics.csv").open(newline="") as file:
        assert [row["epoch"] for row in csv.DictReader(file)] == ["1", "2", "3", "4", "5"]
