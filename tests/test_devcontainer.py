"""The generated dev container's files: devcontainer.json, the Dockerfile, the scripts.

What they do at run time is shown by tests/test_ssh.py (sshd) and
tests/test_devcontainer_e2e.py (a real engine and the Dev Containers CLI).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import json5
import pytest
from conftest import TEMPLATE_DIR, tool
from devcontainer import DEVCONTAINER_CLI_VERSION

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
    """devcontainer.json is JSON with comments (JSONC), as VS Code and the Dev Containers CLI
    read it: its first lines say what it is for."""
    return json5.loads((project / ".devcontainer" / "devcontainer.json").read_text())


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
    # Enough /dev/shm for DataLoader workers without sharing the host's IPC namespace.
    assert "--shm-size=8g" in settings["runArgs"]
    assert "--ipc=host" not in settings["runArgs"]


def test_container_outlives_the_window_and_runs_its_entrypoint(project: Path):
    """VS Code would stop the container when its window closes (shutdownAction's default)
    and replace the entrypoint by a sleep loop (overrideCommand's default)."""
    settings = config(project)
    assert settings["shutdownAction"] == "none"
    assert settings["overrideCommand"] is False
    assert 'ENTRYPOINT ["/usr/local/bin/start-services"]\n' in dockerfile(project)
    # The entrypoint starts the services at every start; a postStartCommand would too.
    assert "postStartCommand" not in settings


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
    # Per workspace: volumes are global per Docker daemon, and two checkouts (or two
    # users of one GPU server) must not share host private keys or caches.
    assert {m["source"] for m in volumes.values()} == {
        "dynamic-model-${devcontainerId}-ssh-host-keys",
        "dynamic-model-${devcontainerId}-pip-cache",
        "dynamic-model-${devcontainerId}-pre-commit-cache",
    }
    assert not any(".ssh" in m["source"] for m in mounts)


def test_collected_keys_stay_out_of_the_build_context(project: Path):
    ignored = (project / ".devcontainer" / ".dockerignore").read_text().splitlines()
    assert "host-ssh-keys/" in ignored
    assert config(project)["build"]["context"] == "."  # the folder of that .dockerignore


@pytest.mark.parametrize(
    ("uid", "gid", "message"),
    [
        ("0", "1000", "DEV_UID=0 DEV_GID=1000 is not allowed: the dev user must not be root"),
        ("1000", "0", "DEV_UID=1000 DEV_GID=0 is not allowed: the dev user must not be root"),
        ("10x", "1000", "DEV_UID=10x is not a number"),
    ],
)
def test_root_or_bad_ids_stop_the_build_before_any_change(project: Path, uid, gid, message):
    """`--build-arg DEV_UID=$(id -u)` run as root gives 0; SSH would then refuse the user."""
    script = project / ".devcontainer" / "create-user.sh"
    accounts = [Path(name).read_bytes() for name in ("/etc/passwd", "/etc/group")]
    result = subprocess.run(
        ["bash", str(script), "dev", uid, gid], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert message in result.stderr
    assert [Path(name).read_bytes() for name in ("/etc/passwd", "/etc/group")] == accounts


def test_user_lifecycle_and_editor(project: Path):
    settings = config(project)
    assert settings["remoteUser"] == settings["build"]["args"]["DEV_USER"] == "dev"
    assert settings["postCreateCommand"] == "bash .devcontainer/post-create.sh"
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

    # A local host: its authorized_keys (who may log in to this machine) is not collected.
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAC3Nz server-login\n")
    subprocess.run(["sh", str(script)], env=host_env, check=True)
    assert sorted(p.name for p in (devcontainer / "host-ssh-keys").iterdir()) == collected

    # A host without ~/.ssh: nothing collected, and no failure.
    shutil.rmtree(home / ".ssh")
    subprocess.run(["sh", str(script)], env=host_env, check=True)
    assert not any((devcontainer / "host-ssh-keys").iterdir())
    assert (devcontainer / ".gitignore").read_text().splitlines() == ["host-ssh-keys/"]


def test_on_a_remote_docker_host_its_login_keys_are_collected(project: Path, tmp_path: Path):
    """VS Code Remote-SSH runs initializeCommand on the server (SSH_CONNECTION set): the
    keys that log the user in there are in its authorized_keys, plain lines only."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    plain = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJm7 me@laptop"
    (home / ".ssh" / "authorized_keys").write_text(
        f"# my laptop\n{plain}\n"
        'command="/bin/backup" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBk2 backup\n'
        'from="10.0.0.1" ssh-rsa AAAAB3NzaC1yc2EAAAADAQAB ci\n'
        "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQ cert\n"
    )
    devcontainer = tmp_path / "project" / ".devcontainer"
    shutil.copytree(project / ".devcontainer", devcontainer)
    script = devcontainer / "collect-host-ssh-keys.sh"
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "SSH_CONNECTION": "10.0.0.2 5 10.0.0.3 22"}
    subprocess.run(["sh", str(script)], env=env, check=True)
    collected = devcontainer / "host-ssh-keys" / "server-authorized-keys.pub"
    assert collected.read_text() == f"{plain}\n"

    # Without one plain line, no file.
    (home / ".ssh" / "authorized_keys").write_text('command="x" ' + plain + "\n")
    subprocess.run(["sh", str(script)], env=env, check=True)
    assert not collected.exists()


def test_a_symlinked_key_folder_is_refused(project: Path, tmp_path: Path):
    """Writing through a link planted at host-ssh-keys/ could overwrite files elsewhere."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519.pub").write_text("ssh-ed25519 AAAA me\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.pub").write_text("not ours")
    devcontainer = tmp_path / "project" / ".devcontainer"
    shutil.copytree(project / ".devcontainer", devcontainer)
    (devcontainer / "host-ssh-keys").symlink_to(elsewhere)
    result = subprocess.run(
        ["sh", str(devcontainer / "collect-host-ssh-keys.sh")],
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "host-ssh-keys is a symbolic link; refusing to write the keys through it" in (
        result.stderr
    )
    assert sorted(p.name for p in elsewhere.iterdir()) == ["kept.pub"]
    assert (elsewhere / "kept.pub").read_text() == "not ours"


def test_readme_explains_the_container(project: Path):
    readme = (project / "README.md").read_text()
    readme += (project / "docs" / "devcontainer.md").read_text()
    assert "<!-- section: devcontainer -->" not in readme
    for expected in (
        "Reopen in Container",
        "Remote-SSH",
        "ssh dynamic-model",
        "Port 2022",
        "    HostKeyAlias dynamic-model\n",
        "docker run -d --name dynamic-model --gpus all --shm-size=8g --init",
        "-p 127.0.0.1:2022:2022",
        "Docker's port rules bypass host firewalls such as ufw and firewalld",
        "shares the host's IPC namespace",
        "is root in the container",
        '`shutdownAction` is `"none"`',
        "dev.containers.gpuAvailability",
        "--gpu-availability all|detect|none",
        '"--device", "nvidia.com/gpu=all"',
        "linux/amd64 only",
        '"BASE_IMAGE": "ubuntu:24.04"',
        "tmux new -s train",
        "pipx install pre-commit",
        "Ports already taken",
        '-v "$PWD":/workspace',
        "--gpus '\"device=0,1\"'",
        ">= 525.60.13",
        '"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu128"',
        "Data and checkpoints",
    ):
        assert expected in readme, expected
    assert ("JupyterLab listens on port 8899" in readme) == jupyter_on(project)
    assert ("-p 127.0.0.1:8899:8899" in readme) == jupyter_on(project)
    # The docker run example publishes on 127.0.0.1 only; other interfaces are an opt-in.
    example = readme.split("```bash\ndocker build -t dynamic-model-dev", 1)[1].split("```")[0]
    published = re.findall(r"-p (\S+)", example)
    assert published
    assert all(port.startswith("127.0.0.1:") for port in published), published


def test_template_dev_container_for_template_developers():
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


def test_python_newer_than_the_image_python_is_refused(tmp_path: Path):
    """The project is installed into the image's Python: pip refuses a newer
    requires-python there, and post-create (then SSH and Jupyter) would fail."""
    from conftest import bake_project
    from cookiecutter.exceptions import FailedHookException

    with pytest.raises(FailedHookException) as refused:
        bake_project(tmp_path, torch_version="2.9.1", cuda_version="12.8", python_version="3.12")
    assert (
        "error: python_version = '3.12' is not allowed: expected a Python version at most "
        "3.11, the Python of the pytorch/pytorch:2.9.1 images (the project must install into "
        "it in the dev container): 3.10, 3.11"
    ) in str(refused.value)
    assert not any(tmp_path.iterdir())
    newest = bake_project(
        tmp_path, torch_version="2.10.0", cuda_version="13.0", python_version="3.12"
    )
    assert newest.is_dir()


def test_every_torch_version_names_its_image_python():
    from conftest import TEMPLATE_DIR

    table = json.loads((TEMPLATE_DIR / "cookiecutter.json").read_text())["_compatibility"]
    assert set(table["image_python"]) == set(table["torch_cuda"])
    for torch, python in table["image_python"].items():
        assert python in table["torch_python"][torch]
