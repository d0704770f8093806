"""SnapshotStore's dying-gasp dump read back by MindSpore's own load_checkpoint: every dtype bit for
bit, large parameters in slices, a corrupt newest snapshot skipped (the store itself:
tests/unit/snapshot/test_store.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mindft.snapshot import ckpt
from mindft.snapshot.slots import checksum

from harness import snapshot_state

pytestmark = pytest.mark.mindspore  # reads the dump back with MindSpore


def _dtype_zoo() -> dict:
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "half": rng.standard_normal(17).astype(np.float16),
        "double": rng.standard_normal((2, 2)),
        "ids": np.arange(-5, 5, dtype=np.int32),
        "global_step": np.array(42, np.int64),
        "mask": rng.random(9) > 0.5,
        "bytes": np.arange(256, dtype=np.uint8),
        "empty": np.zeros((0, 4), np.float32),
    }


def _load_checkpoint(path: Path) -> dict:
    import mindspore  # tests may import MindSpore; mindft.snapshot.store must not

    return {name: parameter.asnumpy() for name, parameter in mindspore.load_checkpoint(str(path)).items()}


@pytest.mark.compat
def test_dump_loads_back_with_mindspore_bytewise(store, tmp_path):
    arrays = _dtype_zoo()
    store.capture(41, {name: np.zeros_like(a) for name, a in arrays.items()})
    store.wait()
    store.capture(42, arrays, {"epoch": 3})
    store.wait()
    path = store.dump(tmp_path / "dump", rank=1, world_size=4)
    assert path.name == "mindft-rank1-step42.ckpt"
    loaded = _load_checkpoint(path)
    assert list(loaded) == list(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        assert loaded[name].tobytes() == array.tobytes(), name
    manifest = json.loads(path.with_suffix(".json").read_text())
    assert manifest["step"] == 42 and manifest["rank"] == 1 and manifest["world_size"] == 4
    assert manifest["meta"] == {"epoch": 3} and manifest["file"] == path.name
    assert manifest["checksums"] == {name: checksum(array) for name, array in arrays.items()}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.with_suffix(".json").name]


def test_dump_writes_large_parameters_in_slices_like_mindspore(store, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "CKPT_SLICE", 1000)  # MindSpore slices at 512 MiB
    arrays = {"big": np.arange(2501, dtype=np.float32).reshape(41, 61), "after": np.ones(3, np.int16)}
    store.capture(7, arrays)
    path = store.dump(tmp_path, rank=0, world_size=1)
    loaded = _load_checkpoint(path)
    assert loaded["big"].tobytes() == arrays["big"].tobytes() and loaded["big"].shape == (41, 61)
    assert loaded["after"].tobytes() == arrays["after"].tobytes()


def test_dump_skips_a_corrupt_newest_snapshot(store, tmp_path):
    for step in (1, 2):
        store.capture(step, snapshot_state(step))
        store.wait()
    store.restore(2).arrays["w"].base[0, 0] = 0.5
    path = store.dump(tmp_path, rank=0, world_size=1)
    assert path.name == "mindft-rank0-step1.ckpt"
    assert np.all(_load_checkpoint(path)["w"] == 1.0)
