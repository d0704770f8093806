"""Dockerfile.train, scripts/check-image and examples/k8s: the fields that make graceful fault tolerance work.

The manifests are read with tests/k8s_manifests.py's parser (PyYAML is not a dependency); the
Volcano job's command run here: tests/integration/test_volcano_job.py.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from k8s_manifests import K8S, containers, load_yaml, parse_yaml, volcano_job

from mindft.config import parse_tft
from mindft.exitcodes import ExitCode
from mindft.cli.launch import main as launch_main
from mindft.device.resetfile import parse_reset

ROOT = Path(__file__).resolve().parents[3]
RESET_DIR = "/user/restore/reset/config"


def test_parser_handles_the_subset() -> None:
    text = "a: 1\nb:\n  - x: '2'\n    y: [\"p\", \"q\"]\n  - plain\nc: >-\n  one\n  two\nd: 0400  # octal\n"
    [doc] = [parse_yaml(text)]
    assert doc == {"a": 1, "b": [{"x": "2", "y": ["p", "q"]}, "plain"], "c": "one two", "d": 0o400}


def test_device_plugin_enables_hot_reset() -> None:
    [daemonset] = load_yaml(K8S / "device-plugin.yaml")
    assert daemonset["kind"] == "DaemonSet"
    [container] = containers(daemonset["spec"]["template"]["spec"])
    assert container["command"] == ["/bin/bash", "-c", "--"]
    words = shlex.split(" ".join(container["args"]))
    assert words[0] == "device-plugin"
    flags = dict(word.lstrip("-").split("=", 1) for word in words[1:])
    assert flags["hotReset"] == "1"
    assert flags["volcanoType"] == "true"
    assert 3 <= int(flags["listWatchPeriod"]) <= 1800
    assert container["securityContext"]["privileged"] is True


def test_volcano_job_mounts_the_reset_configmap() -> None:
    configmap, job = volcano_job()
    name = job["metadata"]["name"]
    assert job["apiVersion"].startswith("batch.volcano.sh/")
    assert job["spec"]["schedulerName"] == "volcano"
    assert configmap["metadata"]["name"] == f"reset-config-{name}"
    assert parse_reset(configmap["data"]["reset.json"]).ranks == ()  # valid and empty at start
    [task] = job["spec"]["tasks"]
    pod = task["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [container] = containers(pod)
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts[RESET_DIR]]["configMap"]["name"] == f"reset-config-{name}"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert parse_tft(env["MS_ENABLE_TFT"]).rsc
    assert env["MINDFT_RESET_FILE"] == f"{RESET_DIR}/reset.json"
    assert volumes[mounts["/etc/mindft/keys"]]["secret"]["defaultMode"] & 0o077 == 0  # key stays private


def test_volcano_job_args_are_valid_launcher_arguments() -> None:
    _, job = volcano_job()
    [task] = job["spec"]["tasks"]
    [container] = containers(task["template"]["spec"])
    context = launch_main.make_context("mindft-launch", list(container["args"]))
    params = context.params
    assert int(params["nnodes"]) == task["replicas"] == job["spec"]["minAvailable"]
    devices = container["resources"]["limits"]["huawei.com/Ascend910"]
    assert params["nproc"] == devices
    assert params["key_file"] is not None  # several nodes need one shared key
    # The training script is one the image contains: Dockerfile.train copies examples/ into /opt/mindft.
    lines = _dockerfile()
    assert lines.index("WORKDIR /opt/mindft") < lines.index("COPY examples ./examples")
    assert params["script"] == "/opt/mindft/examples/train_dp.py"
    assert (ROOT / "examples" / "train_dp.py").exists()
    assert any(port["containerPort"] == params["master_port"] for port in container["ports"])


def _dockerfile() -> list[str]:
    text = (ROOT / "Dockerfile.train").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _run_shell(line: str) -> str:
    """The shell command of a RUN instruction, its --flags dropped."""
    command = line.split(None, 1)[1]
    while command.startswith("--"):
        command = command.split(None, 1)[1]
    return command


def _run_line(needle: str) -> str:
    [line] = [line for line in _dockerfile() if line.startswith("RUN") and needle in line]
    return line


def test_dockerfile_has_no_syntax_directive() -> None:
    # A "# syntax=" parser directive makes BuildKit fetch a frontend image from Docker Hub:
    # offline and air-gapped builds fail at once.
    assert not re.search(r"(?im)^#\s*syntax\s*=", (ROOT / "Dockerfile.train").read_text())


def test_dockerfile_installs_libgomp_before_mindspore_and_imports_it() -> None:
    # MindSpore's CPU kernels link libgomp.so.1, which slim Debian images lack.
    lines = _dockerfile()
    gomp = _run_line("libgomp1")
    assert "apt-get install" in gomp and "--no-install-recommends libgomp1" in gomp
    mindspore = _run_line('pip3 install "${MINDSPORE_PKG}"')
    assert lines.index(gomp) < lines.index(mindspore)
    assert mindspore.endswith('&& python3 -c "import mindspore"')  # a missing library fails the build
    # A new MINDIO_TTP_PKG must not repeat the MindSpore download: a build argument takes part
    # in the cache key of every RUN after its declaration.
    assert lines.index(mindspore) < lines.index('ARG MINDIO_TTP_PKG=""') < lines.index(_run_line("MINDIO_TTP_PKG"))


def _stub(directory: Path, name: str, log: Path) -> None:
    """An executable that records how it was called and exits with $STUB_<NAME>_EXIT (default 0)."""
    path = directory / name
    path.write_text(f'#!/bin/sh\necho "{name} $* (in $PWD)" >> "{log}"\n'
                    f'exit ${{STUB_{name.upper()}_EXIT:-0}}\n')
    path.chmod(0o755)


def _mindio_step(tmp_path: Path, package: str, pip_exit: int = 0) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the Dockerfile's MindIO step with MINDIO_TTP_PKG=``package``, the build context in tmp_path/context.

    pip3 and python3 are stubs that record their calls: what is tested is the step's own
    shell logic (the real installation is what scripts/check-image runs).
    """
    line = _run_line("MINDIO_TTP_PKG")
    mount = dict(option.split("=", 1) for option in re.search(r"--mount=(\S+)", line).group(1).split(","))
    assert mount["type"] == "bind" and mount["source"] == "."  # the whole build context
    context = tmp_path / "context"
    context.mkdir(exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    for name in ("pip3", "python3"):
        _stub(bin_dir, name, log)
    command = _run_shell(line).replace(mount["target"], str(context))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "MINDIO_TTP_PKG": package, "STUB_PIP3_EXIT": str(pip_exit)}
    result = subprocess.run(["/bin/sh", "-c", command], env=env, capture_output=True, text=True, timeout=30)
    return result, (log.read_text().splitlines() if log.exists() else [])


WHEEL = "mindio_ttp-7.3.0-py3-none-linux_x86_64.whl"
MINDIO_IMPORT = "python3 -c import mindio_ttp.framework_ttp"


def test_mindio_step_does_nothing_without_a_package(tmp_path: Path) -> None:
    assert 'ARG MINDIO_TTP_PKG=""' in _dockerfile()
    result, calls = _mindio_step(tmp_path, "")
    assert result.returncode == 0 and calls == []


def test_mindio_step_installs_a_wheel_from_the_build_context_and_imports_it(tmp_path: Path) -> None:
    (tmp_path / "context" / "pkgs").mkdir(parents=True)
    (tmp_path / "context" / "pkgs" / WHEEL).write_bytes(b"")
    result, calls = _mindio_step(tmp_path, f"pkgs/{WHEEL}")
    context = tmp_path / "context"
    assert result.returncode == 0, result.stderr
    assert calls == [f"pip3 install pkgs/{WHEEL} (in {context})", f"{MINDIO_IMPORT} (in {context})"]
    # mindio_ttp imports torch unless told the framework is MindSpore.
    env = " ".join(line for line in _dockerfile() if line.startswith("ENV"))
    assert re.search(r"\bMINDIO_FOR_MINDSPORE=true\b", env)


def test_mindio_step_accepts_a_url(tmp_path: Path) -> None:
    url = f"https://example.invalid/{WHEEL}"
    result, calls = _mindio_step(tmp_path, url)
    assert result.returncode == 0, result.stderr
    assert [call.split(" (in ")[0] for call in calls] == [f"pip3 install {url}", MINDIO_IMPORT]


def test_mindio_step_names_a_wheel_missing_from_the_build_context(tmp_path: Path) -> None:
    # A host path outside the context is the usual mistake (the build sees the context only).
    result, calls = _mindio_step(tmp_path, f"{tmp_path}/outside/{WHEEL}")
    assert result.returncode != 0 and calls == []
    assert f"MINDIO_TTP_PKG={tmp_path}/outside/{WHEEL}: no such file in the build context" in result.stderr
    assert "relative to the context's root" in result.stderr


def test_mindio_step_fails_when_pip_fails(tmp_path: Path) -> None:
    result, calls = _mindio_step(tmp_path, f"https://example.invalid/{WHEEL}", pip_exit=1)
    assert result.returncode != 0
    assert [call.split(" (in ")[0] for call in calls] == [f"pip3 install https://example.invalid/{WHEEL}"]


# --- scripts/check-image: what it does before (and without) a Docker engine ---------------

CHECK_IMAGE = ROOT / "scripts" / "check-image"


@pytest.fixture(scope="module")
def check_image() -> Any:
    """scripts/check-image as a module (it has no .py suffix)."""
    loader = importlib.machinery.SourceFileLoader("check_image", str(CHECK_IMAGE))
    spec = importlib.util.spec_from_loader("check_image", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule for the patterns used here (*, ?, **, !): the last match decides,
    and a pattern that matches a directory excludes what is inside it."""
    ignored = False
    parts = path.split("/")
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = re.escape(pattern.lstrip("!").strip("/"))
        body = body.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(body, "/".join(parts[:count])) for count in range(1, len(parts) + 1)):
            ignored = not negated
    return ignored


def test_dockerignore_keeps_what_the_image_needs(check_image: Any) -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not any(_dockerignored(path, patterns) for path in (
        "setup.py", "setup.cfg", "README.md", "mindft/__init__.py", "mindft/mindspore/backend.py",
        "examples/demo.py", "examples/train_mlp.py", f"pkgs/{WHEEL}", f"{check_image.STAGING}/{WHEEL}"))
    assert all(_dockerignored(path, patterns) for path in (
        ".git", ".venv/bin/python", "mindft/__pycache__/config.cpython-311.pyc", "bench/results/x.json"))


def _run_check_image(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("DOCKER")}
    # Were the arguments accepted, this engine would not answer: exit 1, never a build.
    clean["DOCKER_HOST"] = f"unix://{tmp_path}/no-engine.sock"
    return subprocess.run([sys.executable, str(CHECK_IMAGE), *args], env={**clean, **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: base_image"),
    (["python:3.11-slim", "--mindio-wheel", "missing.whl"], "--mindio-wheel missing.whl: no such file"),
    (["python:3.11-slim", "--mindio-wheel", "notes.txt"], "--mindio-wheel notes.txt: not a wheel"),
    (["python 3.11"], "BASE_IMAGE 'python 3.11' is not an image reference"),
    (["python:3.11-slim", "--docker", "no-such-docker-client"], "--docker no-such-docker-client: no such executable"),
    (["python:3.11-slim", "--heartbeat", "0"], "must be positive"),
], ids=["no-base", "missing-wheel", "not-a-wheel", "bad-base", "bad-client", "bad-heartbeat"])
def test_check_image_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "notes.txt").write_text("not a wheel")
    result = _run_check_image(tmp_path, *args)
    assert result.returncode == ExitCode.USAGE
    assert message in result.stderr


def test_check_image_without_an_engine(tmp_path: Path, check_image: Any) -> None:
    (tmp_path / WHEEL).write_bytes(b"")
    result = _run_check_image(tmp_path, "local/python:3.11-bookworm", "--mindio-wheel", WHEEL)
    assert result.returncode == ExitCode.FAILED
    assert f"no Docker engine answers at unix://{tmp_path}/no-engine.sock" in result.stderr
    assert "dockerd" in result.stderr  # how to start one
    assert not (ROOT / check_image.STAGING).exists()


@contextlib.contextmanager
def _fake_engine(path: Path, reply: bytes) -> Iterator[None]:
    """A unix socket at ``path`` that answers every request with ``reply``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = connection.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                connection.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(5)


def test_check_image_refuses_a_socket_that_is_not_an_engine(tmp_path: Path) -> None:
    sock = tmp_path / "web.sock"
    with _fake_engine(sock, b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope"):
        result = _run_check_image(tmp_path, "python:3.11-slim", DOCKER_HOST=f"unix://{sock}")
    assert result.returncode == ExitCode.FAILED
    assert f"unix://{sock} answered, but not as a Docker engine ('HTTP/1.1 404 Not Found')" in result.stderr


ENGINE_PONG = b"HTTP/1.1 200 OK\r\nApi-Version: 1.41\r\nContent-Length: 2\r\n\r\nOK"


def _stub_docker(directory: Path, version: str, has_buildx: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "docker"
    path.write_text(f'#!/bin/sh\ncase "$1" in\n  buildx) exit {0 if has_buildx else 1} ;;\n'
                    f'  version) echo "{version}" ;;\n  *) exit 1 ;;\nesac\n')
    path.chmod(0o755)
    return path


def test_check_image_without_a_client(tmp_path: Path) -> None:
    sock = tmp_path / "engine.sock"
    with _fake_engine(sock, ENGINE_PONG):
        result = _run_check_image(tmp_path, "python:3.11-slim", DOCKER_HOST=f"unix://{sock}",
                                  PATH=str(tmp_path / "empty"))
    assert result.returncode == ExitCode.FAILED
    assert "no docker client on PATH" in result.stderr and "--docker" in result.stderr


def test_check_image_needs_a_client_that_can_build(tmp_path: Path) -> None:
    sock = tmp_path / "engine.sock"
    _stub_docker(tmp_path / "new", "28.2.2", has_buildx=False)
    with _fake_engine(sock, ENGINE_PONG):
        result = _run_check_image(tmp_path, "python:3.11-slim", DOCKER_HOST=f"unix://{sock}",
                                  PATH=str(tmp_path / "new"))
    assert result.returncode == ExitCode.FAILED
    assert "(version 28) needs the buildx plugin" in result.stderr
    assert "--docker /usr/bin/docker" in result.stderr


def test_client_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check_image: Any) -> None:
    new = _stub_docker(tmp_path / "new", "28.2.2", has_buildx=False)
    old = _stub_docker(tmp_path / "old", "20.10.24+dfsg1", has_buildx=False)
    with_buildx = _stub_docker(tmp_path / "buildx", "28.2.2", has_buildx=True)
    monkeypatch.setenv("PATH", f"{new.parent}:{old.parent}")
    assert check_image.choose_client(None) == str(old)  # the first one on PATH that can build
    assert check_image.choose_client(str(with_buildx)) == str(with_buildx)
    with pytest.raises(check_image.CheckFailed, match="needs the buildx plugin"):
        check_image.choose_client(str(new))


def test_check_image_passes_arguments_after_double_dash_to_the_demo(check_image: Any) -> None:
    args = check_image.parse_args(["local/python:3.11-bookworm", "--tag", "t:1", "--", "--steps", "30", "--verbose"])
    assert (args.base_image, args.tag, args.demo_args) == ("local/python:3.11-bookworm", "t:1",
                                                           ["--steps", "30", "--verbose"])
    assert check_image.parse_args(["img"]).demo_args == []
    assert check_image.parse_args(["img", "--no-cache"]).no_cache and not check_image.parse_args(["img"]).no_cache


def test_stream_shows_progress_while_a_step_is_silent(capsys: pytest.CaptureFixture[str], check_image: Any) -> None:
    script = "import sys, time; print('10%\\r55%\\r100%', flush=True); time.sleep(0.7); print('done'); sys.exit(3)"
    seen: list[str] = []
    code = check_image.stream([sys.executable, "-c", script], "download", 0.2, on_line=seen.append)
    out = capsys.readouterr().out
    assert code == 3
    assert seen == ["100%\n", "done\n"]  # a progress bar's redraws collapse to its last state
    assert "[check-image] download: still running" in out
    assert out.index("  100%") < out.index("still running") < out.index("  done")


def test_dockerfile_enables_rsc_and_starts_the_launcher() -> None:
    lines = _dockerfile()
    [entrypoint] = [line for line in lines if line.startswith("ENTRYPOINT")]
    assert json.loads(entrypoint.split(None, 1)[1]) == ["mindft-launch"]
    env = " ".join(line for line in lines if line.startswith("ENV"))
    match = re.search(r"MS_ENABLE_TFT='([^']*)'", env)
    assert match and parse_tft(match.group(1)).rsc
    assert "MINDFT_RESET_FILE=/user/restore/reset/config/reset.json" in env
    assert any(line.startswith("RUN") and "mindspore" in line.lower() for line in lines) or \
        any("MINDSPORE_PKG=mindspore" in line for line in lines)
    assert any(line.startswith("COPY mindft") for line in lines)


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_every_manifest_has_kind_and_name(path: Path) -> None:
    for document in load_yaml(path):
        assert document["apiVersion"] and document["kind"] and document["metadata"]["name"]
