"""The generated dev container's files: devcontainer.json, the Dockerfile, the scripts.

What they do at run time is shown by tests/test_ssh.py (sshd) and
tests/test_devcontainer_e2e.py (a real engine and the Dev Containers CLI).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Properties of a Dockerfile-based devcontainer.json in the official schema
# (devContainer.base.schema.json: devContainerCommon, nonComposeBase,
# dockerfileContainer), which rejects any other.
SPEC_PROPERTIES = {
    "$schema", "name", "features", "overrideFeatureInstallOrder", "secrets", "forwardPorts",
    "portsAttributes", "otherPortsAttributes", "updateRemoteUserUID", "containerEnv",
    "containerUser", "mounts", "init", "privileged", "capAdd", "securityOpt", "remoteEnv",
    "remoteUser", "initializeCommand", "onCreateCommand", "updateContentCommand",
    "postCreateCommand", "postStartCommand", "postAttachCommand", "waitFor", "userEnvProbe",
    "hostRequirements", "customizations", "appPort", "runArgs", "shutdownAction",
    "overrideCommand", "workspaceFolder", "workspaceMount", "build",
}  # fmt: skip
BUILD_PROPERTIES = {"dockerfile", "context", "target", "args", "cacheFrom"}


def tool(name: str) -> str:
    """A linter installed with the test requirements (beside this interpreter) or on PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: pip install -r requirements-test.txt")
    return found


@pytest.fixture(scope="module", params=[True, False], ids=["jupyter", "no-jupyter"])
def project(request, tmp_path_factory) -> Path:
    from conftest import bake_project

    return bake_project(
        tmp_path_factory.mktemp("devcontainer"),
        jupyter=request.param,
        ssh_port="2022",
        jupyter_port="8899",
        torch_version="2.9.1",
        cuda_version="12.8",
    )


def jupyter_on(project: Path) -> bool:
    return json.loads((project / ".template-answers.json").read_text())["jupyter"]


def config(project: Path) -> dict:
    """devcontainer.json is plain JSON (no comments): JSONC readers and check-json agree."""
    return json.loads((project / ".devcontainer" / "devcontainer.json").read_text())


def dockerfile(project: Path) -> str:
    return (project / ".devcontainer" / "Dockerfile").read_text()


def test_only_properties_of_the_spec(project: Path):
    settings = config(project)
    assert set(settings) <= SPEC_PROPERTIES, set(settings) - SPEC_PROPERTIES
    assert set(settings["build"]) <= BUILD_PROPERTIES


def test_builds_the_dockerfile_on_the_chosen_image(project: Path):
    build = config(project)["build"]
    assert (project / ".devcontainer" / build["context"] / build["dockerfile"]).is_file()
    image = "pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime"
    assert build["args"]["BASE_IMAGE"] == image
    assert f"ARG BASE_IMAGE={image}\n" in dockerfile(project)


def test_gpus_are_optional_and_shared_memory_is_enough(project: Path):
    settings = config(project)
    assert settings["hostRequirements"]["gpu"] == "optional"
    assert not any("--gpus" in arg for arg in settings["runArgs"])
    assert "--ipc=host" in settings["runArgs"] or any(
        arg.startswith("--shm-size") for arg in settings["runArgs"]
    )


def test_ports_are_published_and_named_in_the_environment(project: Path):
    settings = config(project)
    environment = settings["containerEnv"]
    assert environment["PROJECT_SSH_PORT"] == "2022"
    if jupyter_on(project):
        assert settings["appPort"] == [2022, 8899]
        assert environment["PROJECT_JUPYTER_PORT"] == "8899"
        assert "PROJECT_JUPYTER_PORT=8899" in dockerfile(project)
    else:
        assert settings["appPort"] == [2022]
        assert "PROJECT_JUPYTER_PORT" not in environment
        assert "JUPYTER" not in dockerfile(project).upper()
    assert "PROJECT_SSH_PORT=2022" in dockerfile(project)


def test_caches_and_host_keys_are_volumes_and_no_private_key_is_mounted(project: Path):
    mounts = [dict(part.split("=", 1) for part in m.split(",")) for m in config(project)["mounts"]]
    volumes = {m["target"]: m for m in mounts if m["type"] == "volume"}
    assert set(volumes) == {
        "/etc/ssh/host-keys",
        "/home/dev/.cache/pip",
        "/home/dev/.cache/pre-commit",
    }
    assert not any(".ssh" in m["source"] for m in mounts)


def test_user_lifecycle_and_editor(project: Path):
    settings = config(project)
    assert settings["remoteUser"] == settings["build"]["args"]["DEV_USER"] == "dev"
    assert settings["postCreateCommand"] == "bash .devcontainer/post-create.sh"
    assert settings["postStartCommand"] == "start-services"
    assert settings["initializeCommand"][1].endswith("/.devcontainer/collect-host-ssh-keys.sh")
    vscode = settings["customizations"]["vscode"]
    assert {"ms-python.python", "ms-toolsai.jupyter"} <= set(vscode["extensions"])
    assert vscode["settings"]["python.testing.pytestEnabled"] is True
    assert vscode["settings"]["python.defaultInterpreterPath"] == "/home/dev/.venv/bin/python"
    post_create = (project / ".devcontainer" / "post-create.sh").read_text()
    assert "dynamic-model-doctor" in post_create
    assert "safe.directory" in post_create


def test_jupyter_files_follow_the_answer(project: Path):
    has_script = (project / ".devcontainer" / "start-jupyter.sh").exists()
    assert has_script == jupyter_on(project)
    assert ("jupyterlab==" in dockerfile(project)) == jupyter_on(project)


def test_dockerfile_copies_only_files_that_exist(project: Path):
    sources = re.findall(r"^COPY (\S+) ", dockerfile(project), flags=re.MULTILINE)
    assert sources
    for source in sources:
        assert (project / ".devcontainer" / source).is_file(), source


def test_pip_is_constrained_to_the_base_image_torch(project: Path):
    text = dockerfile(project)
    assert "ENV PIP_CONSTRAINT=/etc/pip/constraints.txt" in text
    # torch is installed only in the nvidia/cuda flavor, from the index it names.
    assert "ARG TORCH_INDEX_URL=\n" in text
    assert "ARG TORCH_VERSION=2.9.1\n" in text
    runs = re.findall(r"^RUN (?:.*\\\n)*.*", text, flags=re.MULTILINE)
    installing_torch = [run for run in runs if re.search(r"pip install[^;]*torch==", run)]
    assert len(installing_torch) == 1
    assert installing_torch[0].startswith('RUN if [ -n "${TORCH_INDEX_URL}" ]; then')
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in installing_torch[0]


def test_dockerfile_passes_hadolint(project: Path):
    result = subprocess.run(
        [tool("hadolint"), str(project / ".devcontainer" / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_an_unexplained_unpinned_install(project: Path, tmp_path: Path):
    broken = tmp_path / "Dockerfile"
    broken.write_text(dockerfile(project).replace("# hadolint ignore=DL3008\n", ""))
    result = subprocess.run([tool("hadolint"), str(broken)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3008" in result.stdout


def test_scripts_pass_shellcheck(project: Path):
    scripts = sorted((project / ".devcontainer").glob("*.sh"))
    result = subprocess.run(
        [tool("shellcheck"), *map(str, scripts)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_host_public_keys_are_collected_without_private_keys(project: Path, tmp_path: Path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE")
    (home / ".ssh" / "id_ed25519.pub").write_text("ssh-ed25519 AAAA me\n")
    devcontainer = tmp_path / "project" / ".devcontainer"
    shutil.copytree(project / ".devcontainer", devcontainer)
    (devcontainer / "host-ssh-keys").mkdir(exist_ok=True)
    (devcontainer / "host-ssh-keys" / "removed-from-host.pub").write_text("old")
    script = devcontainer / "collect-host-ssh-keys.sh"

    host_env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    subprocess.run(["sh", str(script)], env=host_env, check=True)
    collected = sorted(p.name for p in (devcontainer / "host-ssh-keys").iterdir())
    assert collected == ["id_ed25519.pub"]

    # A host without ~/.ssh: nothing collected, and no failure.
    (home / ".ssh" / "id_ed25519.pub").unlink()
    subprocess.run(["sh", str(script)], env=host_env, check=True)
    assert not any((devcontainer / "host-ssh-keys").iterdir())
    assert (devcontainer / ".gitignore").read_text().splitlines() == ["host-ssh-keys/"]


def test_readme_explains_the_container(project: Path):
    readme = (project / "README.md").read_text()
    assert "<!-- section: devcontainer -->" not in readme
    for expected in (
        "Reopen in Container",
        "Remote-SSH",
        "ssh dynamic-model",
        "Port 2022",
        "docker run -d --name dynamic-model --gpus all",
        '-v "$PWD":/workspace',
        "--gpus '\"device=0,1\"'",
        ">= 525.60.13",
        '"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu128"',
        "Data and checkpoints",
    ):
        assert expected in readme, expected
    assert ("JupyterLab listens on port 8899" in readme) == jupyter_on(project)


def test_template_dev_container_for_template_developers():
    from conftest import TEMPLATE_DIR
    from test_devcontainer_e2e import DEVCONTAINER_CLI_VERSION

    folder = TEMPLATE_DIR / ".devcontainer"
    settings = json.loads((folder / "devcontainer.json").read_text())
    assert set(settings) <= SPEC_PROPERTIES
    assert settings["privileged"] is True  # the end-to-end test runs its own dockerd
    text = (folder / "Dockerfile").read_text()
    assert "COPY .ci/apt-packages.txt" in text
    assert f"ARG DEVCONTAINER_CLI_VERSION={DEVCONTAINER_CLI_VERSION}\n" in text
    result = subprocess.run(
        [tool("hadolint"), str(folder / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
