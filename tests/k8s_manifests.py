"""The manifests of examples/k8s read without PyYAML (not a dependency): a small parser for the
block-YAML subset they use (mappings, sequences, scalars, JSON flow values, folded/literal
block scalars) that fails loudly on anything else. Shared by tests/unit/test_deploy.py and
tests/integration/test_volcano_job.py."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

K8S = Path(__file__).resolve().parent.parent / "examples" / "k8s"


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


def parse_yaml(text: str) -> Any:
    """One document of the subset."""
    return _Parser(text).parse()


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers of a pod's spec."""
    return pod_spec["containers"]


def volcano_job() -> tuple[dict[str, Any], dict[str, Any]]:
    """examples/k8s/volcano-job.yaml's ConfigMap and Job."""
    documents = load_yaml(K8S / "volcano-job.yaml")
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"ConfigMap", "Job"}
    return kinds["ConfigMap"], kinds["Job"]
