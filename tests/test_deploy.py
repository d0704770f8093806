"""Dockerfile.train and examples/k8s: the fields that make graceful fault tolerance work.

PyYAML is not a dependency, so the manifests are read with a small parser for the
block-YAML subset they use (mappings, sequences, scalars, JSON flow values,
folded/literal block scalars); it fails loudly on anything else.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from mindft.config import parse_tft
from mindft.launch import main as launch_main
from mindft.resetwatch import parse_reset

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "examples" / "k8s"
RESET_DIR = "/user/restore/reset/config"


def _strip_comment(text: str) -> str:
    quote = None
    for index, char in enumerate(text):
        if quote:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "#" and (index == 0 or text[index - 1] in " \t"):
            return text[:index].rstrip()
    return text.rstrip()


def _scalar(text: str) -> Any:
    text = text.strip()
    if text[:1] in "\"[{":
        return json.loads(text)
    if text[:1] == "'":
        return text[1:-1].replace("''", "'")
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "~", ""):
        return None
    if re.fullmatch(r"-?\d+", text):
        return int(text, 8) if len(text) > 1 and text.startswith("0") else int(text)
    return text


def _split_key(content: str) -> tuple[str, str] | None:
    match = re.match(r"([A-Za-z0-9_.\-/]+):(?:\s+(.*))?$", content)
    return (match.group(1), match.group(2) or "") if match else None


class _Parser:
    def __init__(self, text: str) -> None:
        self.lines: list[tuple[int, str]] = []
        raw_lines = text.splitlines()
        self.raw = raw_lines
        for number, raw in enumerate(raw_lines):
            self.lines.append((number, raw))

    def parse(self) -> Any:
        self.items = [(len(raw) - len(raw.lstrip(" ")), _strip_comment(raw.strip()), number)
                      for number, raw in self.lines if _strip_comment(raw.strip())]
        value, index = self._block(0, self.items[0][0])
        assert index == len(self.items), f"unparsed YAML from line {self.items[index][2] + 1}"
        return value

    def _block_scalar(self, index: int, indent: int, style: str) -> tuple[str, int]:
        start = self.items[index - 1][2] + 1
        end = start
        texts = []
        while end < len(self.raw) and (not self.raw[end].strip()
                                        or len(self.raw[end]) - len(self.raw[end].lstrip()) > indent):
            texts.append(self.raw[end].strip())
            end += 1
        while index < len(self.items) and self.items[index][2] < end:
            index += 1
        texts = [t for t in texts if t]
        return (" ".join(texts) if style.startswith(">") else "\n".join(texts) + "\n"), index

    def _value(self, rest: str, index: int, indent: int) -> tuple[Any, int]:
        if rest in ("|", "|-", ">", ">-"):
            return self._block_scalar(index, indent, rest)
        if rest:
            return _scalar(rest), index
        if index < len(self.items) and (self.items[index][0] > indent or self._item_at(index, indent, "- ")):
            return self._block(index, self.items[index][0])
        return None, index

    def _item_at(self, index: int, indent: int, prefix: str) -> bool:
        return index < len(self.items) and self.items[index][0] == indent and self.items[index][1].startswith(prefix)

    def _block(self, index: int, indent: int) -> tuple[Any, int]:
        if self.items[index][1].startswith("-"):
            result: list[Any] = []
            while self._item_at(index, indent, "-"):
                text = self.items[index][1][1:].strip()
                index += 1
                if _split_key(text) and not text.startswith(("\"", "'")):
                    self.items.insert(index, (indent + 2, text, self.items[index - 1][2]))
                    value, index = self._block(index, indent + 2)
                else:
                    value, index = self._value(text, index, indent)
                result.append(value)
            return result, index
        mapping: dict[str, Any] = {}
        while index < len(self.items) and self.items[index][0] == indent and not self._item_at(index, indent, "- "):
            pair = _split_key(self.items[index][1])
            assert pair, f"not a mapping entry on line {self.items[index][2] + 1}: {self.items[index][1]!r}"
            key, rest = pair
            value, index = self._value(rest, index + 1, indent)
            mapping[key] = value
        return mapping, index


def load_yaml(path: Path) -> list[Any]:
    """Every document in ``path``."""
    documents = re.split(r"(?m)^---\s*$", path.read_text())
    return [_Parser(doc).parse() for doc in documents
            if any(_strip_comment(line.strip()) for line in doc.splitlines())]


def test_parser_handles_the_subset() -> None:
    text = "a: 1\nb:\n  - x: '2'\n    y: [\"p\", \"q\"]\n  - plain\nc: >-\n  one\n  two\nd: 0400  # octal\n"
    [doc] = [_Parser(text).parse()]
    assert doc == {"a": 1, "b": [{"x": "2", "y": ["p", "q"]}, "plain"], "c": "one two", "d": 0o400}


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec["containers"]


def test_device_plugin_enables_hot_reset() -> None:
    [daemonset] = load_yaml(K8S / "device-plugin.yaml")
    assert daemonset["kind"] == "DaemonSet"
    [container] = _containers(daemonset["spec"]["template"]["spec"])
    assert container["command"] == ["/bin/bash", "-c", "--"]
    words = shlex.split(" ".join(container["args"]))
    assert words[0] == "device-plugin"
    flags = dict(word.lstrip("-").split("=", 1) for word in words[1:])
    assert flags["hotReset"] == "1"
    assert flags["volcanoType"] == "true"
    assert 3 <= int(flags["listWatchPeriod"]) <= 1800
    assert container["securityContext"]["privileged"] is True


def _volcano_job() -> tuple[dict[str, Any], dict[str, Any]]:
    documents = load_yaml(K8S / "volcano-job.yaml")
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"ConfigMap", "Job"}
    return kinds["ConfigMap"], kinds["Job"]


def test_volcano_job_mounts_the_reset_configmap() -> None:
    configmap, job = _volcano_job()
    name = job["metadata"]["name"]
    assert job["apiVersion"].startswith("batch.volcano.sh/")
    assert job["spec"]["schedulerName"] == "volcano"
    assert configmap["metadata"]["name"] == f"reset-config-{name}"
    assert parse_reset(configmap["data"]["reset.json"]).ranks == ()  # valid and empty at start
    [task] = job["spec"]["tasks"]
    pod = task["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [container] = _containers(pod)
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts[RESET_DIR]]["configMap"]["name"] == f"reset-config-{name}"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert parse_tft(env["MS_ENABLE_TFT"]).rsc
    assert env["MINDFT_RESET_FILE"] == f"{RESET_DIR}/reset.json"
    assert volumes[mounts["/etc/mindft/keys"]]["secret"]["defaultMode"] & 0o077 == 0  # key stays private


def test_volcano_job_args_are_valid_launcher_arguments() -> None:
    _, job = _volcano_job()
    [task] = job["spec"]["tasks"]
    [container] = _containers(task["template"]["spec"])
    context = launch_main.make_context("mindft-launch", list(container["args"]))
    params = context.params
    assert params["nnodes"] == task["replicas"] == job["spec"]["minAvailable"]
    devices = container["resources"]["limits"]["huawei.com/Ascend910"]
    assert params["nproc"] == devices
    assert params["key_file"] is not None  # several nodes need one shared key
    # The training script is one the image contains: Dockerfile.train copies examples/ into /opt/mindft.
    lines = _dockerfile()
    assert lines.index("WORKDIR /opt/mindft") < lines.index("COPY examples ./examples")
    assert params["script"] == "/opt/mindft/examples/train_mlp.py"
    assert (ROOT / "examples" / "train_mlp.py").exists()
    assert any(port["containerPort"] == params["master_port"] for port in container["ports"])


def _dockerfile() -> list[str]:
    text = (ROOT / "Dockerfile.train").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_installs_mindio_only_when_given() -> None:
    lines = _dockerfile()
    assert 'ARG MINDIO_TTP_PKG=""' in lines
    [install] = [line for line in lines if "MINDIO_TTP_PKG}" in line and line.startswith("RUN")]
    pattern = r'if \[ -n "\$\{MINDIO_TTP_PKG\}" \]; then .*pip3 install "\$\{MINDIO_TTP_PKG\}"; fi'
    assert re.search(pattern, install)


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
