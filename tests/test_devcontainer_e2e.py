"""End to end: the generated dev container, built and started by the real Dev
Containers CLI on a real Docker engine, then used the way people use it, on stand-ins
for each layout of the real base images.

No image can be pulled here. One root filesystem is made once and cached: Debian
bookworm from debootstrap with python3, python3-pip and python3-venv (Python 3.11,
the Python of the local torch CPU wheel), that wheel and numpy in
/usr/local/lib/python3.11/dist-packages, and a user "ubuntu" at UID 1000. Each
stand-in is derived from it by a small offline docker build (`Layout.recipe`) and
reproduces the facts of the real image that the Dockerfile depends on:

- `SYSTEM_PYTHON` stands for pytorch/pytorch 2.10 and newer, the default image
  (torch 2.13.0): the distribution's Python with python3-pip but without its venv
  package, so ensurepip is missing and `python3 -m venv` fails ("ensurepip is not
  available") until the build adds it; torch in /usr/local/lib/python3.X/dist-packages;
  the EXTERNALLY-MANAGED marker present; runs as root; UID 1000 taken by "ubuntu"
  (Ubuntu 24.04). The real images have Python 3.12; the stand-in has 3.11.
- `CONDA` stands for pytorch/pytorch 2.8 and 2.9: a root-owned Python prefix at
  /opt/conda (the distribution's interpreter and standard library copied there,
  with ensurepip and no EXTERNALLY-MANAGED marker), first on PATH, torch inside it;
  no /usr/bin/python3 (the distribution's Python is purged, as Ubuntu 22.04's
  images have none) and no user at UID 1000. Differences that nothing here depends
  on: torch is in /opt/conda/lib/python3.11/dist-packages (Debian's site layout
  under that prefix) where conda has site-packages, that folder is a link to where
  the common root filesystem keeps torch (moving it would copy 800 MB), and there
  is no conda command.
- `CUDA` stands for nvidia/cuda:*-ubuntu24.04: no Python, no torch (the build
  installs both, torch from TORCH_INDEX_URL, here a local index on 127.0.0.1 with
  the CPU wheel), user "ubuntu" at UID 1000, NVIDIA_REQUIRE_CUDA set (inert: no
  engine here has the NVIDIA runtime, and none of the stand-ins has CUDA).

`SYSTEM_PYTHON` runs the whole flow: `devcontainer up`, the project's tests inside,
SSH, Jupyter, the container outliving the CLI's session and restarted with
`docker stop`/`docker start` (start-services runs from the image's entrypoint),
a rebuild that keeps the host keys, plain `docker run`, and a build with DEV_UID 0.
Meanwhile, in two threads, `CONDA` is brought up with `devcontainer up` and `CUDA`
is built and started with plain `docker run`, each checked where it differs: the
environment sees the image's torch, the user, SSH, and (CONDA) a host key of its
own. What the variants have in common is shared: one cached root filesystem, and
one pip cache volume (a test override), so a wheel is downloaded once per run.

The engine is a private dockerd (own data root and socket, no bridge, no iptables);
containers and builds use the host network, and only 127.0.0.1 is contacted.
Everything is torn down at the end, the daemon by its PID. One test function runs
the whole flow: a module-scoped fixture would be started once per xdist worker.
"""

from __future__ import annotations

import concurrent.futures
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

import json5
import pytest
from conftest import bake_project
from devcontainer import DEVCONTAINER_CLI_VERSION

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
            # Containers go first (their mounts); images and volumes go with the data root.
            containers = engine("ps", "-aq", check=False).stdout.split()
            if containers:
                engine("rm", "-f", "-v", *containers, check=False)
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


SHARED_PIP_CACHE = "e2e-shared-pip-cache"


def write_override(project: Path, base_image: str, **build_args: str) -> Path:
    """The generated config with the stand-in base image, the host network, and the pip
    cache volume shared by every variant (so a wheel is downloaded once per run)."""
    config = json5.loads((project / ".devcontainer" / "devcontainer.json").read_text())
    config["build"]["args"].update(BASE_IMAGE=base_image, **build_args)
    config["build"]["options"] = ["--network=host"]
    config["runArgs"] = [*config.get("runArgs", []), "--network=host"]
    config["mounts"] = [
        f"source={SHARED_PIP_CACHE},target=/home/dev/.cache/pip,type=volume"
        if "target=/home/dev/.cache/pip," in mount
        else mount
        for mount in config["mounts"]
    ]
    # Beside the original, so that relative paths (Dockerfile, context) resolve alike.
    override = project / ".devcontainer" / "e2e-override.json"
    override.write_text(json.dumps(config, indent=2))
    return override


@dataclass(frozen=True)
class Layout:
    """A stand-in for one layout of the real base images: what it stands for, and the
    offline build steps that turn the common stand-in root filesystem into it."""

    name: str
    stands_for: str
    recipe: str


SYSTEM_PYTHON = Layout(
    "system-python",
    "pytorch/pytorch 2.10 and newer (Ubuntu 24.04, the system Python, no python3-venv)",
    # python3 and python3-pip only: without the venv package there is no ensurepip.
    r"""
RUN dpkg --purge python3-venv python3.11-venv \
    && ! python3 -m venv /tmp/venv-check >/tmp/venv-check.log 2>&1 \
    && grep -q "because ensurepip is not" /tmp/venv-check.log \
    && rm -rf /tmp/venv-check /tmp/venv-check.log \
    && test -f /usr/lib/python3.11/EXTERNALLY-MANAGED
""",
)
CONDA = Layout(
    "conda",
    "pytorch/pytorch 2.8 and 2.9 (Ubuntu 22.04, Miniforge Python 3.11 at /opt/conda)",
    # A root-owned Python prefix at /opt/conda with ensurepip and torch, first on PATH;
    # the distribution's Python and the UID 1000 user are removed (Ubuntu 22.04 has none).
    r"""
ARG SITE=/opt/conda/lib/python3.11/dist-packages
RUN mkdir -p /opt/conda/bin /opt/conda/lib/python3.11 \
    && cp /usr/bin/python3.11 /opt/conda/bin/ \
    && ln -s python3.11 /opt/conda/bin/python3 && ln -s python3.11 /opt/conda/bin/python \
    && cp -a /usr/lib/python3.11/. /opt/conda/lib/python3.11/ \
    && rm -f /opt/conda/lib/python3.11/EXTERNALLY-MANAGED \
        /opt/conda/lib/python3.11/sitecustomize.py \
    && ln -s /usr/local/lib/python3.11/dist-packages "$SITE" \
    && cp -a --no-clobber /usr/lib/python3/dist-packages/. "$SITE/" \
    && apt-mark manual python3-pip-whl python3-setuptools-whl \
    && apt-get purge -y python3.11-minimal libpython3.11-minimal \
    && rm -rf /usr/lib/python3 \
    && userdel --remove ubuntu
ENV PATH=/opt/conda/bin:$PATH
RUN test "$(command -v python3)" = /opt/conda/bin/python3 && ! test -e /usr/bin/python3 \
    && test "$(stat -c %U:%a /opt/conda/lib/python3.11)" = root:755 \
    && python3 -c 'import ensurepip, torch; assert torch.__file__.startswith("/opt/conda/")'
""",
)
CUDA = Layout(
    "nvidia-cuda",
    "nvidia/cuda:<version>-runtime-ubuntu24.04 (no Python, no torch, user ubuntu at UID 1000)",
    r"""
RUN apt-get purge -y python3.11-minimal libpython3.11-minimal \
    && rm -rf /usr/local/lib/python3.11 /usr/lib/python3 \
    && ! command -v python3 && test "$(id -u ubuntu)" = 1000
ENV NVIDIA_REQUIRE_CUDA="cuda>=13.0" NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
""",
)


def derive(engine: Engine, base: str, layout: Layout, folder: Path) -> str:
    """The stand-in for ``layout``: a small offline build on the common root filesystem."""
    folder.mkdir(parents=True)
    (folder / "Dockerfile").write_text(f"FROM {base}{layout.recipe}WORKDIR /workspace\n")
    tag = f"standin-{layout.name}"
    engine("build", "--network=none", "--tag", tag, folder, timeout=900)
    return tag


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


def make_box(engine: Engine, cli: Path, root: Path, base_image: str, **answers) -> DevContainer:
    """A generated project (its own ports), a host user's home with a key, and the CLI."""
    build_args = answers.pop("build_args", None) or {}
    ssh_port, jupyter_port = free_port(), free_port()
    project = bake_project(root, ssh_port=str(ssh_port), jupyter_port=str(jupyter_port), **answers)
    # Owned by UID 1000, the container user's, as a host user's folder would be after
    # the CLI gives the container user the host user's UID (it keeps it for root).
    for path in (project, *project.rglob("*")):
        os.chown(path, 1000, 1000)
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    key = home / ".ssh" / "id_ed25519"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], timeout=60)
    override = write_override(project, base_image, **build_args)
    return DevContainer(engine, cli, project, override, home, key, ssh_port, jupyter_port)


def environment_probe(execute) -> dict:
    """What the project's environment sees in the container (``execute(*command)`` runs a
    command there): prefixes, torch, the user, a system python3, NVIDIA_REQUIRE_CUDA."""
    script = (
        "import json, os, pwd, shutil, sys, torch; print(json.dumps({"
        "'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'torch': torch.__version__, "
        "'torch_file': torch.__file__, 'user': pwd.getpwuid(os.getuid()).pw_name, "
        "'uid': os.getuid(), 'ubuntu_user': any(p.pw_name == 'ubuntu' for p in pwd.getpwall()), "
        "'system_python3': os.path.exists('/usr/bin/python3'), "
        "'constraint': open('/etc/pip/constraints.txt').read().strip(), "
        "'nvidia_require_cuda': os.environ.get('NVIDIA_REQUIRE_CUDA')}))"
    )
    return json.loads(execute("python", "-c", script).stdout.strip().splitlines()[-1])


def assert_sees_the_image_torch(probe: dict, base_prefix: str, torch_dir: str) -> None:
    """The project's venv is built on the image's Python and imports the image's torch,
    to which every pip install is constrained."""
    assert (probe["prefix"], probe["base_prefix"]) == ("/home/dev/.venv", base_prefix)
    assert probe["torch"] == f"{TORCH_VERSION}+cpu"
    assert probe["torch_file"].startswith(f"{torch_dir}/torch/"), probe["torch_file"]
    assert probe["constraint"] == f"torch=={TORCH_VERSION}+cpu"


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def conda_flow(box: DevContainer) -> dict:
    """pytorch/pytorch 2.8 and 2.9 (Miniforge Python at /opt/conda): devcontainer up, then
    what the environment sees, an SSH session and the host key."""
    box.up()
    probe = environment_probe(box.exec)
    wait_for_port(box.ssh_port)
    session = box.ssh("dev", "python -c 'import dynamic_model, torch; print(torch.__file__)'")
    return {**probe, "ssh_torch_file": session.stdout.strip(), "host_key": box.host_key()}


def cuda_flow(engine: Engine, box: DevContainer, base_image: str, index_root: Path) -> dict:
    """nvidia/cuda (no Python, no torch): the image built with TORCH_INDEX_URL (a local
    index with the CPU wheel) and run with plain docker run; what it sees, and SSH."""
    with local_index(index_root) as index_url:
        engine(
            "build", "--network=host", "--tag", "flavor-e2e",
            "--build-arg", f"BASE_IMAGE={base_image}",
            "--build-arg", f"TORCH_INDEX_URL={index_url}",
            box.project / ".devcontainer",
            timeout=1800,
        )  # fmt: skip
    engine(
        "run", "--detach", "--name", "nvidia-cuda-flavor", "--network=host", "--init",
        "-e", f"PROJECT_SSH_PORT={box.ssh_port}",
        "-e", f"SSH_AUTHORIZED_KEYS={box.key.with_suffix('.pub').read_text()}",
        "-v", f"{box.project}:/workspace",
        "flavor-e2e",
    )  # fmt: skip
    probe = environment_probe(functools.partial(engine, "exec", "nvidia-cuda-flavor"))
    wait_for_port(box.ssh_port)
    return {**probe, "ssh": box.ssh("dev", "python -c 'import torch' && echo ok").stdout.strip()}


def test_devcontainer_end_to_end(
    engine, standin_image, devcontainer_cli, tmp_path, record_property
):
    started = time.monotonic()
    times: dict[str, int] = {}

    def lap(name: str) -> None:
        times[name] = round(time.monotonic() - started)

    def derived(layout: Layout) -> str:
        return derive(engine, standin_image, layout, tmp_path / f"standin-{layout.name}")

    system = derived(SYSTEM_PYTHON)
    conda_image, cuda_image = f"standin-{CONDA.name}", f"standin-{CUDA.name}"
    lap("system-python: stand-in derived")
    # Projects are generated here, one at a time (cookiecutter changes the working folder).
    box = make_box(engine, devcontainer_cli, tmp_path / "system", system)
    conda = make_box(engine, devcontainer_cli, tmp_path / "conda", conda_image, jupyter=False)
    cuda = make_box(engine, devcontainer_cli, tmp_path / "cuda", cuda_image, jupyter=False)

    def conda_layout() -> dict:
        derived(CONDA)
        seen = conda_flow(conda)
        lap("conda: stand-in, devcontainer up, checks")
        return seen

    def cuda_layout() -> dict:
        derived(CUDA)
        seen = cuda_flow(engine, cuda, cuda_image, tmp_path / "index")
        lap("nvidia-cuda: stand-in, build, docker run, checks")
        return seen

    # The other two layouts are derived and checked while the first runs its whole
    # flow: the builds wait on downloads and disk more than on the CPU.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        conda_seen, cuda_seen = pool.submit(conda_layout), pool.submit(cuda_layout)
        host_key = system_flow(engine, box, system, lap)

        # --- pytorch/pytorch 2.8 and 2.9: the venv is made from /opt/conda's Python
        # and sees its torch; the build installed no second Python.
        probe = conda_seen.result(timeout=1800)
        assert_sees_the_image_torch(probe, "/opt/conda", "/opt/conda/lib/python3.11/dist-packages")
        assert probe["system_python3"] is False
        assert (probe["user"], probe["uid"]) == ("dev", 1000)
        assert probe["ssh_torch_file"].startswith("/opt/conda/lib/python3.11/dist-packages/")
        # Another checkout of a project with the same name: its own host-key volume.
        assert probe["host_key"] != host_key

        # --- nvidia/cuda: Python and torch installed by the build; ubuntu (UID 1000)
        # renamed to dev; NVIDIA_REQUIRE_CUDA inherited.
        probe = cuda_seen.result(timeout=1800)
        assert_sees_the_image_torch(probe, "/usr", "/usr/local/lib/python3.11/dist-packages")
        assert (probe["user"], probe["uid"], probe["ubuntu_user"]) == ("dev", 1000, False)
        assert probe["nvidia_require_cuda"] == "cuda>=13.0"
        assert probe["ssh"] == "ok"

    volumes = engine("volume", "ls", "--format", "{{.Name}}").stdout.split()
    host_key_volumes = [v for v in volumes if re.fullmatch(r"dynamic-model-\w+-ssh-host-keys", v)]
    assert len(host_key_volumes) == 2, volumes  # one per checkout
    elapsed = time.monotonic() - started
    images = engine("images", "--format", "{{.Repository}} {{.Size}}").stdout
    record_property("devcontainer_e2e_seconds", round(elapsed))
    record_property("devcontainer_e2e_laps", json.dumps(times))
    record_property("devcontainer_images", images)
    print(f"dev container end to end: {elapsed:.0f} s; laps: {times}; images:\n{images}")


def system_flow(engine: Engine, box: DevContainer, base_image: str, lap) -> str:
    """pytorch/pytorch 2.10 and newer, the default image: the whole flow. Returns the
    container's SSH host key."""
    # Reopen in Container: build, create, postCreate (install, services, doctor).
    outcome, log = box.up()
    lap("system-python: devcontainer up")
    assert "is not a git repository, so the pre-commit hooks are not installed yet" in log

    # The venv was made although the image's Python has no ensurepip (the build added
    # the venv package), and it sees the image's torch, which pip left alone.
    probe = environment_probe(box.exec)
    assert_sees_the_image_torch(probe, "/usr", "/usr/local/lib/python3.11/dist-packages")
    # The base image's UID 1000 user was renamed, not duplicated.
    assert (probe["user"], probe["uid"], probe["ubuntu_user"]) == ("dev", 1000, False)
    assert box.exec("tmux", "-V").stdout.startswith("tmux ")

    # The project's own tests pass inside the container, the slow ones too, less the runs
    # of the docs' examples (the same in any environment: test_template_project runs them).
    tests = box.exec(
        "pytest", "-q", "-m", "slow or not slow", "--deselect", "tests/test_docs.py",
        timeout=900, check=False,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-3000:]
    lap("system-python: project tests")

    # SSH with the host user's key, as the dev user only, in the project's environment;
    # sshd logs the login (LogLevel VERBOSE) to a file the dev user reads.
    wait_for_port(box.ssh_port)
    session = box.ssh(
        "dev", "cd /workspace && python -c 'import dynamic_model' && echo $VIRTUAL_ENV"
    )
    assert session.stdout.strip() == "/home/dev/.venv"
    refused = box.ssh("root", "true", check=False)
    assert refused.returncode == 255
    assert "Permission denied" in refused.stderr
    logged = box.ssh("dev", "cat /run/devcontainer-sshd/sshd.log").stdout
    assert re.search(r"Accepted publickey for dev .* ED25519 SHA256:", logged), logged

    # JupyterLab answers only with its token.
    wait_for_port(box.jupyter_port)
    token = box.exec("cat", "/home/dev/.jupyter/devcontainer-token").stdout.strip()
    assert len(token) >= 32
    assert http_status(f"http://127.0.0.1:{box.jupyter_port}/api/status") == 403
    assert http_status(f"http://127.0.0.1:{box.jupyter_port}/api/status?token={token}") == 200

    # The container outlives the CLI's session (shutdownAction "none" asks VS Code for
    # the same), and its command is the image's entrypoint (overrideCommand false): a
    # plain docker stop/start, as after a reboot, brings SSH and Jupyter back by itself.
    container = outcome["containerId"]
    state = engine("inspect", "--format", "{{.State.Running}} {{json .Args}}", container).stdout
    assert state.startswith("true "), state
    assert "/usr/local/bin/start-services" in state
    engine("stop", container, timeout=120)
    assert not port_open(box.ssh_port)
    engine("start", container, timeout=120)
    wait_for_port(box.ssh_port)
    assert box.ssh("dev", "echo back").stdout.strip() == "back"
    wait_for_port(box.jupyter_port)
    assert http_status(f"http://127.0.0.1:{box.jupyter_port}/api/status?token={token}") == 200
    lap("system-python: restarted with docker")

    # Named volumes carry the workspace's ${devcontainerId}, so other checkouts and
    # other users of this engine get their own host keys and caches.
    volumes = engine("volume", "ls", "--format", "{{.Name}}").stdout.split()
    assert not any("${" in volume for volume in volumes), volumes
    assert any(re.fullmatch(r"dynamic-model-\w{20,}-ssh-host-keys", v) for v in volumes), volumes

    # A rebuild keeps the SSH host key (a volume), so known_hosts stays valid; in a
    # git repository, it installs the pre-commit hook.
    run(["git", "init", "--quiet", box.project], timeout=60)
    for path in (box.project / ".git", *(box.project / ".git").rglob("*")):
        os.chown(path, 1000, 1000)
    host_key = box.host_key()
    rebuilt, _ = box.up("--remove-existing-container")
    lap("system-python: rebuild")
    assert (box.project / ".git" / "hooks" / "pre-commit").is_file()
    wait_for_port(box.ssh_port)
    assert box.host_key() == host_key
    box.ssh("dev", "true")

    # The same image without VS Code: plain docker run, the key in SSH_AUTHORIZED_KEYS.
    image = engine("inspect", "--format", "{{.Image}}", rebuilt["containerId"]).stdout.strip()
    run_ssh_port, run_jupyter_port = free_port(), free_port()
    engine(
        "run", "--detach", "--name", "plain-docker-run", "--network=host", "--init",
        "-e", f"PROJECT_SSH_PORT={run_ssh_port}",
        "-e", f"PROJECT_JUPYTER_PORT={run_jupyter_port}",
        "-e", f"SSH_AUTHORIZED_KEYS={box.key.with_suffix('.pub').read_text()}",
        "-v", f"{box.project}:/workspace",
        image,
    )  # fmt: skip
    wait_for_port(run_ssh_port)
    plain = box.ssh("dev", "python -c 'import torch; print(torch.__version__)'", port=run_ssh_port)
    assert plain.stdout.strip() == f"{TORCH_VERSION}+cpu"
    wait_for_port(run_jupyter_port)
    logs = engine("logs", "plain-docker-run").stdout
    assert f"    Port {run_ssh_port}\n" in logs
    assert "    HostKeyAlias dynamic-model\n" in logs
    assert f"http://localhost:{run_jupyter_port}/lab?token=" in logs

    # DEV_UID 0 (--build-arg DEV_UID=$(id -u) run as root) stops the build, naming why;
    # the steps before the user's come from the cache.
    as_root = engine(
        "build", "--network=host", "--build-arg", f"BASE_IMAGE={base_image}",
        "--build-arg", "DEV_UID=0", box.project / ".devcontainer",
        check=False, timeout=1800,
    )  # fmt: skip
    assert as_root.returncode != 0
    assert "DEV_UID=0 DEV_GID=1000 is not allowed" in as_root.stdout + as_root.stderr
    lap("system-python: docker run and DEV_UID=0")
    return host_key
