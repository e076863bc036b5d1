"""End to end: the generated dev container, built and started by the real Dev
Containers CLI on a real Docker engine, then used the way people use it.

No image can be pulled here, so the CUDA base image is replaced by a local
stand-in with the same shape: Debian bookworm (Python 3.11) from debootstrap,
the local torch CPU wheel, and a user "ubuntu" at UID 1000 like the Ubuntu 24.04
CUDA images. The engine is a private dockerd (own data root and socket, no bridge,
no iptables); containers and builds use the host network, and only 127.0.0.1 is
contacted. Everything is torn down at the end, the daemon by its PID.

One test function runs the whole flow: a module-scoped fixture would be started
once per xdist worker.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import bake_project

DEVCONTAINER_CLI_VERSION = "0.89.0"
STANDIN_IMAGE = "devcontainer-e2e-standin:bookworm"
# Bump when the stand-in recipe changes, so a cached tarball is rebuilt.
STANDIN_RECIPE = 1
DEBIAN_MIRROR = "http://deb.debian.org/debian"
TORCH_VERSION = version("torch").split("+")[0]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dynamic-model-template"


def torch_cpu_wheel() -> Path | None:
    """The local torch CPU wheel for Python 3.11 (the stand-in's Python), if on disk."""
    folders = [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]
    for folder in folders:
        folder = folder.removeprefix("file://")
        if os.path.isdir(folder):
            found = sorted(Path(folder).glob(f"torch-{TORCH_VERSION}+cpu-cp311-cp311-*x86_64.whl"))
            if found:
                return found[0]
    return None


def docker_client() -> str | None:
    """The docker client shipped with dockerd (a newer one elsewhere on PATH may not match)."""
    dockerd = shutil.which("dockerd")
    if dockerd:
        beside = Path(dockerd).resolve().parent.parent / "bin" / "docker"
        if beside.exists():
            return str(beside)
    return shutil.which("docker")


def missing_requirement() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux to run a Docker engine"
    if os.geteuid() != 0:
        return "needs root to run its own Docker engine"
    for tool, package in (
        ("dockerd", "docker.io"),
        ("debootstrap", "debootstrap"),
        ("ssh", "openssh-client"),
        ("npm", "Node.js 20 with npm"),
    ):
        if not shutil.which(tool):
            return f"needs {tool} ({package})"
    if torch_cpu_wheel() is None:
        return f"needs the torch {TORCH_VERSION} CPU wheel for Python 3.11 on disk (PIP_FIND_LINKS)"
    return None


MISSING = missing_requirement()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


def run(args, *, timeout: float, env=None, check=True, cwd=None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {result.returncode}\n"
            f"--- stdout (end)\n{result.stdout[-6000:]}\n--- stderr (end)\n{result.stderr[-6000:]}"
        )
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Engine:
    docker: str
    socket: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", **extra}

    def __call__(self, *args, timeout: float = 300, check: bool = True):
        return run([self.docker, *args], timeout=timeout, env=self.env(), check=check)


@pytest.fixture(scope="module")
def engine():
    """A private dockerd: its own data root and socket, no bridge, no iptables."""
    # A short folder: a unix socket's path is limited to about 100 bytes.
    root = Path(tempfile.mkdtemp(prefix="dc-e2e-", dir="/tmp"))
    log = (root / "dockerd.log").open("w")
    daemon = subprocess.Popen(
        [
            "dockerd",
            f"--data-root={root / 'data'}",
            f"--exec-root={root / 'exec'}",
            f"--pidfile={root / 'dockerd.pid'}",
            f"--host=unix://{root / 'docker.sock'}",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    engine = Engine(docker_client(), root / "docker.sock")
    try:
        for _ in range(120):
            if daemon.poll() is None and engine("version", check=False, timeout=30).returncode == 0:
                break
            if daemon.poll() is not None:
                break
            time.sleep(0.5)
        else:
            daemon.poll()
        if daemon.returncode is not None or engine("version", check=False).returncode != 0:
            log_tail = (root / "dockerd.log").read_text()[-4000:]
            raise AssertionError(f"dockerd did not start:\n{log_tail}")
        yield engine
    finally:
        if daemon.poll() is None:
            containers = engine("ps", "-aq", check=False).stdout.split()
            if containers:
                engine("rm", "-f", "-v", *containers, check=False)
            volumes = engine("volume", "ls", "-q", check=False).stdout.split()
            if volumes:
                engine("volume", "rm", "-f", *volumes, check=False)
            images = engine("images", "-aq", check=False).stdout.split()
            if images:
                engine("rmi", "-f", *images, check=False)
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        log.close()
        unmount_all_under(root)
        shutil.rmtree(root, ignore_errors=True)


def unmount_all_under(root: Path) -> None:
    """What dockerd left mounted in its folders (its network namespace file), deepest first."""
    targets = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    inside = [t for t in targets if t == str(root) or t.startswith(f"{root}/")]
    for target in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "--lazy", target], capture_output=True)


def standin_rootfs_tarball() -> Path:
    """A Debian bookworm root filesystem shaped like the CUDA base images, cached."""
    tarball = CACHE / f"standin-bookworm-torch{TORCH_VERSION}-recipe{STANDIN_RECIPE}.tar"
    if tarball.exists():
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="standin-", dir=CACHE) as work:
        rootfs = Path(work) / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-pip,python3-venv,ca-certificates",
                "bookworm",
                rootfs,
                DEBIAN_MIRROR,
            ],
            timeout=900,
        )
        site_packages = rootfs / "usr/local/lib/python3.11/dist-packages"
        run(
            [
                sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
                "--target", site_packages,
                torch_cpu_wheel(), f"numpy=={version('numpy')}",
            ],
            timeout=900,
        )  # fmt: skip
        # The same trust store as this machine, whose HTTPS goes through a proxy
        # with its own certificate authority; pip reads the system store.
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/")
        (rootfs / "etc/pip.conf").write_text(
            "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n"
        )
        # Like the Ubuntu 24.04 CUDA images: UID 1000 is taken by "ubuntu".
        run(["chroot", rootfs, "useradd", "--uid", "1000", "--create-home", "ubuntu"], timeout=60)
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        partial = tarball.with_suffix(".partial")
        run(["tar", "-C", rootfs, "-cf", partial, "."], timeout=600)
        partial.rename(tarball)
    return tarball


@pytest.fixture(scope="module")
def standin_image(engine: Engine) -> str:
    tarball = standin_rootfs_tarball()
    run(
        ["sh", "-c", f'"{engine.docker}" import - {STANDIN_IMAGE} < "{tarball}"'],
        timeout=600,
        env=engine.env(),
    )
    return STANDIN_IMAGE


@pytest.fixture(scope="module")
def devcontainer_cli() -> Path:
    """The pinned Dev Containers CLI: on PATH (the template's dev container), else
    installed from npm once into the cache."""
    on_path = shutil.which("devcontainer")
    if on_path and run([on_path, "--version"], timeout=60).stdout.strip() == (
        DEVCONTAINER_CLI_VERSION
    ):
        return Path(on_path)
    prefix = CACHE / f"devcontainers-cli-{DEVCONTAINER_CLI_VERSION}"
    executable = prefix / "node_modules" / ".bin" / "devcontainer"
    if not executable.exists():
        run(
            [
                "npm", "install", "--no-save", "--no-audit", "--no-fund",
                "--prefix", prefix, f"@devcontainers/cli@{DEVCONTAINER_CLI_VERSION}",
            ],
            timeout=600,
        )  # fmt: skip
    return executable


@dataclass
class DevContainer:
    engine: Engine
    cli: Path
    project: Path
    override: Path
    home: Path
    key: Path
    ssh_port: int
    jupyter_port: int

    def cli_run(self, subcommand: str, *args, timeout: float = 1800, check: bool = True):
        return run(
            [
                self.cli, subcommand,
                "--workspace-folder", self.project,
                "--docker-path", self.engine.docker,
                "--override-config", self.override,
                *args,
            ],
            timeout=timeout,
            env=self.engine.env(HOME=str(self.home)),
            check=check,
        )  # fmt: skip

    def up(self, *extra: str) -> tuple[dict, str]:
        """``devcontainer up``: its result, and its log (the lifecycle commands' output)."""
        result = self.cli_run("up", *extra)
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        assert outcome["outcome"] == "success", result.stdout[-6000:] + result.stderr[-6000:]
        return outcome, result.stderr

    def exec(self, *command: str, timeout: float = 600, check: bool = True):
        return self.cli_run("exec", *command, timeout=timeout, check=check)

    def ssh(self, user: str, *command: str, check: bool = True, port: int | None = None):
        return run(
            [
                "ssh", "-F", "/dev/null", "-p", port or self.ssh_port,
                "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-i", self.key,
                "-o", f"UserKnownHostsFile={self.home / 'known_hosts'}",
                "-o", "StrictHostKeyChecking=accept-new", "-o", "ConnectTimeout=30",
                f"{user}@127.0.0.1", *command,
            ],
            timeout=120,
            check=check,
        )  # fmt: skip

    def host_key(self) -> str:
        scan = run(["ssh-keyscan", "-t", "ed25519", "-p", self.ssh_port, "127.0.0.1"], timeout=60)
        return scan.stdout.split(None, 1)[1].strip()


def write_override(project: Path, base_image: str) -> Path:
    """The generated config with the stand-in base image and the host network."""
    config = json.loads((project / ".devcontainer" / "devcontainer.json").read_text())
    config["build"]["args"]["BASE_IMAGE"] = base_image
    config["build"]["options"] = ["--network=host"]
    config["runArgs"] = [*config.get("runArgs", []), "--network=host"]
    # Beside the original, so that relative paths (Dockerfile, context) resolve alike.
    override = project / ".devcontainer" / "e2e-override.json"
    override.write_text(json.dumps(config, indent=2))
    return override


def without_torch(engine: Engine, base: str, context: Path) -> str:
    """The stand-in without torch, like an nvidia/cuda image."""
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {base}\nRUN rm -rf /usr/local/lib/python3.11/dist-packages/*\n"
    )
    engine("build", "--network=none", "--tag", "standin-without-torch", context)
    return "standin-without-torch"


@contextlib.contextmanager
def local_index(root: Path):
    """A package index on 127.0.0.1 (PEP 503 layout) with the torch wheel and what it needs."""
    downloads = root / "downloads"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--dest",
            downloads,
            torch_cpu_wheel(),
        ],
        timeout=900,
    )
    for file in downloads.iterdir():
        project = re.sub(r"[-_.]+", "-", file.name.split("-")[0]).lower()
        folder = root / "simple" / project
        folder.mkdir(parents=True, exist_ok=True)
        file.rename(folder / file.name)
        with (folder / "index.html").open("a") as page:
            page.write(f'<a href="{file.name}">{file.name}</a>\n')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/simple"
    finally:
        server.shutdown()
        server.server_close()


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_for_port(port: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


def test_devcontainer_end_to_end(
    engine, standin_image, devcontainer_cli, tmp_path, record_property
):
    started = time.monotonic()
    ssh_port, jupyter_port = free_port(), free_port()
    project = bake_project(
        tmp_path, ssh_port=str(ssh_port), jupyter_port=str(jupyter_port), jupyter=True
    )
    # Owned by UID 1000, the container user's, as a host user's folder would be after
    # the CLI gives the container user the host user's UID (it keeps it for root).
    for path in (project, *project.rglob("*")):
        os.chown(path, 1000, 1000)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = home / ".ssh" / "id_ed25519"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], timeout=60)
    box = DevContainer(
        engine, devcontainer_cli, project, write_override(project, standin_image),
        home, key, ssh_port, jupyter_port,
    )  # fmt: skip

    # Reopen in Container: build, create, postCreate (install), postStart (services).
    _, log = box.up()
    assert "is not a git repository, so the pre-commit hooks are not installed yet" in log
    record_property("devcontainer_up_seconds", round(time.monotonic() - started))

    # The project is installed over the base image's torch, which pip left alone.
    probe = box.exec(
        "python", "-c",
        "import sys, torch, dynamic_model; print(sys.prefix); print(torch.__version__); "
        "print(torch.__file__)",
    ).stdout.split()  # fmt: skip
    assert probe[0] == "/home/dev/.venv"
    assert probe[1] == f"{TORCH_VERSION}+cpu"
    assert probe[2].startswith("/usr/local/lib/python3.11/dist-packages/torch/")

    # The base image's UID 1000 user was renamed, not duplicated.
    ids = box.exec("sh", "-c", "id -un; id -u; getent passwd ubuntu || echo no-ubuntu").stdout
    assert ids.split() == ["dev", "1000", "no-ubuntu"]

    # The project's own tests pass inside the container.
    tests = box.exec("pytest", "-q", timeout=900, check=False)
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-3000:]

    # SSH with the host user's key, as the dev user only, in the project's environment.
    wait_for_port(ssh_port)
    session = box.ssh(
        "dev", "cd /workspace && python -c 'import dynamic_model' && echo $VIRTUAL_ENV"
    )
    assert session.stdout.strip() == "/home/dev/.venv"
    refused = box.ssh("root", "true", check=False)
    assert refused.returncode == 255
    assert "Permission denied" in refused.stderr

    # JupyterLab answers only with its token.
    wait_for_port(jupyter_port)
    token = box.exec("cat", "/home/dev/.jupyter/devcontainer-token").stdout.strip()
    assert len(token) >= 32
    assert http_status(f"http://127.0.0.1:{jupyter_port}/api/status") == 403
    assert http_status(f"http://127.0.0.1:{jupyter_port}/api/status?token={token}") == 200

    # A rebuild keeps the SSH host key (a volume), so known_hosts stays valid; in a
    # git repository, it installs the pre-commit hook.
    run(["git", "init", "--quiet", project], timeout=60)
    for path in (project / ".git", *(project / ".git").rglob("*")):
        os.chown(path, 1000, 1000)
    host_key = box.host_key()
    rebuilt, _ = box.up("--remove-existing-container")
    assert (project / ".git" / "hooks" / "pre-commit").is_file()
    wait_for_port(ssh_port)
    assert box.host_key() == host_key
    box.ssh("dev", "true")

    # The same image without VS Code: plain docker run, the key in SSH_AUTHORIZED_KEYS.
    image = engine("inspect", "--format", "{{.Image}}", rebuilt["containerId"]).stdout.strip()
    run_ssh_port, run_jupyter_port = free_port(), free_port()
    engine(
        "run", "--detach", "--name", "plain-docker-run", "--network=host", "--init",
        "-e", f"PROJECT_SSH_PORT={run_ssh_port}",
        "-e", f"PROJECT_JUPYTER_PORT={run_jupyter_port}",
        "-e", f"SSH_AUTHORIZED_KEYS={key.with_suffix('.pub').read_text()}",
        "-v", f"{project}:/workspace",
        image,
    )  # fmt: skip
    wait_for_port(run_ssh_port)
    plain = box.ssh("dev", "python -c 'import torch; print(torch.__version__)'", port=run_ssh_port)
    assert plain.stdout.strip() == f"{TORCH_VERSION}+cpu"
    wait_for_port(run_jupyter_port)
    logs = engine("logs", "plain-docker-run").stdout
    assert f"    Port {run_ssh_port}\n" in logs
    assert f"http://localhost:{run_jupyter_port}/lab?token=" in logs

    # The nvidia/cuda flavor: a base without torch, which the build installs from
    # TORCH_INDEX_URL (here a local index holding the CPU wheel and its dependencies).
    flavor = bake_project(tmp_path / "flavor", jupyter=False)
    bare = without_torch(engine, standin_image, tmp_path / "bare")
    with local_index(tmp_path / "index") as index_url:
        engine(
            "build", "--network=host", "--tag", "flavor-e2e",
            "--build-arg", f"BASE_IMAGE={bare}",
            "--build-arg", f"TORCH_INDEX_URL={index_url}",
            flavor / ".devcontainer",
            timeout=1800,
        )  # fmt: skip
    installed = engine(
        "run", "--rm", "--network=none", "--entrypoint", "python", "flavor-e2e", "-c",
        "import torch; print(torch.__version__); print(torch.__file__); "
        "print(open('/etc/pip/constraints.txt').read())",
    ).stdout.split()  # fmt: skip
    assert installed[0] == f"{TORCH_VERSION}+cpu"
    assert installed[1].startswith("/usr/local/lib/python3.11/dist-packages/torch/")
    assert installed[2] == f"torch=={TORCH_VERSION}+cpu"

    elapsed = time.monotonic() - started
    images = engine("images", "--format", "{{.Repository}} {{.Size}}").stdout
    record_property("devcontainer_e2e_seconds", round(elapsed))
    record_property("devcontainer_images", images)
    print(f"dev container end to end: {elapsed:.0f} s; images:\n{images}")
