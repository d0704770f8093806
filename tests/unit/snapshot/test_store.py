"""SnapshotStore: double buffering, checksums, restore fallback, memory reuse, dying-gasp dump."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mindft.snapshot import store as snapshot_module
from mindft.snapshot.slots import checksum, read_manifest
from mindft.snapshot.store import Snapshot, SnapshotError, SnapshotStore
from mindft.observe.units import size_from_text, size_text

from harness import snapshot_state


def test_capture_is_a_true_copy_and_restores(store):
    arrays = snapshot_state(1.0)
    store.capture(1, arrays, {"epoch": 0, "batch": 7})
    store.wait()
    arrays["w"][:] = 99.0  # the training step after the capture mutates the live arrays
    restored = store.restore()
    assert restored.step == 1
    assert restored.meta == {"epoch": 0, "batch": 7}
    assert np.all(restored.arrays["w"] == 1.0) and int(restored.arrays["step"]) == 1
    assert restored.checksums["w"] == checksum(np.full((100, 10), 1.0, np.float32))
    with pytest.raises(ValueError):
        restored.arrays["w"][0, 0] = 5.0  # views into the store are read-only


def test_keeps_the_two_newest_steps(store):
    for step in (1, 2, 3):
        store.capture(step, snapshot_state(step))
        store.wait()
    assert store.steps == (2, 3)
    assert store.restore().step == 3
    assert np.all(store.restore(2).arrays["adam.m"] == 2.0)
    with pytest.raises(SnapshotError, match="no verified snapshot for step <= 1"):
        store.restore(1)


def test_restore_protects_the_restored_slot_from_the_next_capture(store):
    for step in (1, 2):
        store.capture(step, snapshot_state(step))
        store.wait()
    assert store.restore(1).step == 1  # roll back: step 2 is now the one to overwrite
    store.capture(2, snapshot_state(20))
    store.wait()
    assert store.steps == (1, 2)
    assert np.all(store.restore(1).arrays["w"] == 1.0)
    assert np.all(store.restore(2).arrays["w"] == 20.0)


class _FailingSource(np.ndarray):
    """Device memory that fails while being read: the copy thread raises once ``go`` is set."""

    go = threading.Event()

    def __array_function__(self, func, types, args, kwargs):
        if func is np.copyto:
            self.go.wait(10)
            raise MemoryError("simulated device fault during the copy")
        return super().__array_function__(func, types, args, kwargs)


def test_crash_mid_capture_keeps_the_previous_snapshot(store):
    for step in (1, 2):
        store.capture(step, snapshot_state(step))
        store.wait()
    arrays = snapshot_state(3.0)
    arrays["adam.m"] = arrays["adam.m"].view(_FailingSource)  # "w" is copied first, then this fails
    _FailingSource.go.clear()
    store.capture(3, arrays)
    # Capture in flight: the slot being overwritten no longer counts, the newest is untouched.
    assert store.steps == (2,)
    assert store.restore().step == 2
    _FailingSource.go.set()
    with pytest.raises(SnapshotError, match="capture of step 3 failed.*MemoryError"):
        store.wait()
    assert store.steps == (2,)
    restored = store.restore()
    assert restored.step == 2 and np.all(restored.arrays["w"] == 2.0)
    store.capture(4, snapshot_state(4))  # the store keeps working after a failed capture
    store.wait()
    assert store.steps == (2, 4)


def test_abandoned_capture_is_never_restored(store):
    store.capture(1, snapshot_state(1))
    store.wait()
    _FailingSource.go.clear()
    arrays = snapshot_state(2.0)
    arrays["w"] = arrays["w"].view(_FailingSource)
    store.capture(2, arrays)  # never waited for: the process "dies" here
    assert store.restore().step == 1
    _FailingSource.go.set()


def test_corrupt_snapshot_falls_back_to_the_older_one(store):
    for step in (1, 2):
        store.capture(step, snapshot_state(step))
        store.wait()
    buffer = store.restore(2).arrays["adam.m"].base  # the store's own buffer
    buffer.view(np.uint8)[1234] ^= 0x10  # a bit flip in host memory
    restored = store.restore()
    assert restored.step == 1 and np.all(restored.arrays["adam.m"] == 1.0)
    assert store.steps == (1,)  # the corrupt one is dropped for good
    store.restore(1).arrays["w"].base.view(np.uint8)[0] ^= 1
    with pytest.raises(SnapshotError, match=r"step 1 \(checksum mismatch in w\)"):
        store.restore()
    assert store.steps == ()


def test_restore_into_copies_verified_data(store):
    for step in (1, 2):
        store.capture(step, snapshot_state(step))
        store.wait()
    store.restore(2).arrays["w"].base[3, 3] = -1.0
    model = snapshot_state(0.0)
    assert store.restore(into=model).step == 1
    assert all(np.all(model[name] == 1.0) for name in model)  # overwritten again by the good snapshot
    with pytest.raises(SnapshotError, match="names differ"):
        store.restore(into={"w": model["w"]})


def test_concurrent_capture_and_restore(store):
    stop = threading.Event()
    errors = []

    def train():
        arrays = snapshot_state(0.0, size=200_000)
        try:
            for step in range(1, 201):
                for array in arrays.values():
                    array.fill(step)
                store.capture(step, arrays, {"step": step})
                store.wait()
        except BaseException as error:
            errors.append(error)
        finally:
            stop.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    model, seen = snapshot_state(0.0, size=200_000), set()
    while not stop.is_set():
        try:
            restored = store.restore(into=model)
        except SnapshotError:
            continue  # nothing captured yet
        seen.add(restored.step)
        # Never a torn snapshot: everything copied out belongs to the step restore named.
        assert restored.meta["step"] == restored.step
        assert all(np.all(model[name] == restored.step) for name in model)
    trainer.join()
    assert not errors
    assert len(seen) > 1
    assert store.steps == (199, 200)


def test_memory_does_not_grow_over_1000_captures(store):
    arrays = snapshot_state(0.0, size=10_000)
    for step in (1, 2):
        store.capture(step, arrays)
        store.wait()
    buffers = {id(store.restore(step).arrays["w"].base): store.restore(step).arrays["w"].base for step in (1, 2)}
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for step in range(3, 1003):
            arrays["w"][0, 0] = step
            store.capture(step, arrays, {"step": step})
        store.wait()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.steps == (1001, 1002)
    assert store.restore().arrays["w"][0, 0] == 1002
    for step in (1001, 1002):
        assert any(store.restore(step).arrays["w"].base is buffer for buffer in buffers.values())
    # 1,000 captures copied ~120 MB; a per-capture allocation would show up here.
    assert after - before < 64 * 1024


def test_nbytes_is_at_most_two_copies(store):
    arrays = snapshot_state(1.0, size=10_000)
    state_bytes = sum(array.nbytes for array in arrays.values())
    assert store.nbytes == 0
    for step in range(5):
        store.capture(step, arrays)
        store.wait()
        assert store.nbytes <= 2 * state_bytes
    assert store.nbytes == 2 * state_bytes
    smaller = snapshot_state(1.0, size=100)
    for step in range(5, 7):
        store.capture(step, smaller)
        store.wait()
    assert store.nbytes == 2 * sum(array.nbytes for array in smaller.values())


def test_adopt_verifies_checksums(store):
    arrays = snapshot_state(5.0)
    good = Snapshot(5, arrays, {"epoch": 1}, {name: checksum(array) for name, array in arrays.items()})
    bad = Snapshot(6, arrays, {}, {**good.checksums, "w": good.checksums["w"] ^ 1})
    with pytest.raises(SnapshotError, match=r"step 6 does not match its checksums \(w\)"):
        store.adopt(bad)
    assert store.steps == ()
    store.adopt(good)
    assert store.steps == (5,)
    restored = store.restore()
    assert restored.meta == {"epoch": 1} and np.all(restored.arrays["adam.m"] == 5.0)


def test_capture_rejects_what_it_cannot_snapshot(store):
    with pytest.raises(SnapshotError, match="object"):
        store.capture(1, {"x": np.array([object()])})
    with pytest.raises(TypeError):
        store.capture(1, snapshot_state(1.0), {"rng": object()})
    assert store.steps == ()


def test_dump_without_snapshot_fails_and_writes_nothing(store, tmp_path):
    with pytest.raises(SnapshotError, match="none held"):
        store.dump(tmp_path, rank=0, world_size=1)
    assert list(tmp_path.iterdir()) == []


_DUMP_SCRIPT = """
import resource, signal, sys
import numpy as np
from pathlib import Path
from mindft.snapshot.store import SnapshotStore, SnapshotError
store = SnapshotStore()
store.capture(9, {"a": np.ones(1 << 20, np.float32), "b": np.ones(1 << 20, np.float32)})
store.wait()
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# Python ignores SIGXFSZ, so an oversized write fails with EFBIG; SIG_DFL makes the kernel kill us.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN if sys.argv[2] == "error" else signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))
try:
    store.dump(Path(sys.argv[1]), rank=0, world_size=1)
except SnapshotError as error:
    print("refused:", error)
    sys.exit(0)
sys.exit("the dump did not fail")
"""


def _dump_under_file_size_limit(directory: Path, mode: str) -> subprocess.CompletedProcess:
    """Dump 8 MiB in a child whose file-size limit is 3 MiB: the kernel stops it half-way."""
    return subprocess.run([sys.executable, "-c", _DUMP_SCRIPT, str(directory), mode],
                          capture_output=True, text=True, timeout=60)


def test_partial_dump_is_cleaned_up_after_a_write_error(tmp_path):
    result = _dump_under_file_size_limit(tmp_path, "error")
    assert result.returncode == 0, result.stderr
    assert "dump of step 9" in result.stdout and "File too large" in result.stdout
    assert list(tmp_path.iterdir()) == []  # neither a partial .ckpt nor a leftover temporary file


def test_partial_dump_never_left_under_the_final_name(tmp_path):
    result = _dump_under_file_size_limit(tmp_path, "kill")  # SIGXFSZ kills the child mid-write
    assert result.returncode == -signal.SIGXFSZ, result.stderr
    leftovers = [path.name for path in tmp_path.iterdir()]
    assert leftovers and all(name.startswith(".") and name.endswith(".tmp") for name in leftovers), leftovers
    assert leftovers[0].startswith(".mindft-rank0-step9.ckpt.")


def test_crc32_fallback_when_xxhash_is_missing(store, monkeypatch):
    import zlib

    monkeypatch.setattr(snapshot_module, "CHECKSUM", "crc32")  # what mindft uses without xxhash
    store.capture(1, snapshot_state(1.0))
    store.wait()
    restored = store.restore()
    assert restored.algorithm == "crc32"
    assert restored.checksums["w"] == zlib.crc32(snapshot_state(1.0)["w"].tobytes())
    other = SnapshotStore()
    monkeypatch.undo()  # a rank with xxhash still adopts (and verifies) a crc32 snapshot
    other.adopt(restored)
    assert other.restore().algorithm == "crc32" and other.steps == (1,)
    other.close()


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((33, 7)).astype(np.float32), "b": rng.standard_normal(5),
            "step": np.array(seed, dtype=np.int64), "empty": np.zeros((0, 3), np.float32)}


def test_snapshots_in_a_home_outlive_the_store_that_wrote_them(tmp_path: Path) -> None:
    home = tmp_path / "agent" / "rank0"
    store = SnapshotStore(home=home)
    for step in (1, 2, 3):
        store.capture(step, _state(step), {"step": step})
        store.wait()
    store.close()
    again = SnapshotStore(home=home, resume=True)  # a restarted process of the same rank
    try:
        assert again.steps == (2, 3)
        target = {k: np.empty_like(v) for k, v in _state(0).items()}
        snapshot = again.restore(2, into=target)
        assert snapshot.step == 2 and snapshot.meta == {"step": 2}
        for name, value in _state(2).items():
            assert target[name].tobytes() == value.tobytes() and target[name].shape == value.shape
        again.capture(4, _state(4))  # after a rollback to 2, step 3 is the abandoned future
        again.wait()
        assert again.steps == (2, 4)
    finally:
        again.close()


def test_a_fresh_store_discards_what_a_previous_job_left(tmp_path: Path) -> None:
    with SnapshotStore(home=tmp_path) as store:
        store.capture(7, _state(7))
        store.wait()
    with SnapshotStore(home=tmp_path) as fresh:
        assert fresh.steps == ()
    with SnapshotStore(home=tmp_path, resume=True) as resumed:
        assert resumed.steps == ()


def test_a_capture_cut_short_leaves_the_previous_snapshot_in_the_home(tmp_path: Path) -> None:
    with SnapshotStore(home=tmp_path) as store:
        for step in (1, 2):
            store.capture(step, _state(step))
            store.wait()
    # The capture of step 3 claims the slot of step 1 and forgets it first; the process dies then.
    older = next(p for p in tmp_path.glob("slot*.json") if json.loads(p.read_text())["step"] == 1)
    older.unlink()
    with SnapshotStore(home=tmp_path, resume=True) as resumed:
        assert resumed.steps == (2,)
        assert resumed.restore().step == 2


def test_a_corrupted_home_snapshot_fails_verification(tmp_path: Path) -> None:
    with SnapshotStore(home=tmp_path) as store:
        store.capture(1, _state(1))
        store.wait()
    data = bytearray((tmp_path / "slot0.bin").read_bytes())
    data[0] ^= 0xFF
    (tmp_path / "slot0.bin").write_bytes(bytes(data))
    with SnapshotStore(home=tmp_path, resume=True) as resumed:
        assert resumed.steps == (1,)
        with pytest.raises(SnapshotError, match="checksum mismatch"):
            resumed.restore(1)


def test_a_slot_manifest_is_read_once_and_knows_when_its_slot_is_overwritten(tmp_path: Path) -> None:
    with SnapshotStore(home=tmp_path) as store:
        store.capture(1, _state(1), {"epoch": 0})
        store.wait()
        slot = next(p for p in tmp_path.glob("slot*.json") if json.loads(p.read_text())["step"] == 1)
        manifest = read_manifest(slot)
        assert manifest is not None and manifest.step == 1 and manifest.meta == {"epoch": 0}
        assert manifest.data == slot.with_suffix(".bin")
        assert [name for name, _, _, _ in manifest.layout] == list(_state(1))
        for name, dtype, shape, start in manifest.layout:
            value = _state(1)[name]
            assert (dtype, shape) == (value.dtype.str, value.shape)
            assert manifest.checksums[name] == checksum(value, manifest.algorithm)
            stored = np.frombuffer(manifest.data.read_bytes()[start:start + value.nbytes], dtype)
            assert stored.tobytes() == value.tobytes()
        assert manifest.intact()
        store.capture(2, _state(2))
        store.wait()
        store.capture(3, _state(3))  # the slot of step 1
        store.wait()
        assert not manifest.intact()
        assert read_manifest(slot).step == 3


def test_a_garbage_manifest_is_named_and_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with SnapshotStore(home=tmp_path) as store:
        for step in (1, 2):
            store.capture(step, _state(step))
            store.wait()
    older = next(p for p in tmp_path.glob("slot*.json") if json.loads(p.read_text())["step"] == 1)
    older.write_text('{"step": 1, "layout": [')
    assert read_manifest(older) is None
    assert read_manifest(tmp_path / "slot9.json") is None  # no such slot: nothing to say
    assert [(r.levelname, r.getMessage().startswith(f"ignoring the snapshot in {older}: "))
            for r in caplog.records] == [("WARNING", True)]
    with SnapshotStore(home=tmp_path, resume=True) as resumed:
        assert resumed.steps == (2,)


def test_an_unusable_home_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SnapshotError, match="MINDFT_STATE_DIR: cannot create"):
        SnapshotStore(home=blocker / "rank0")


@pytest.mark.parametrize("nbytes", [0, 512, 1536, 96 * 2**20, 3 * 2**30])
def test_a_printed_size_reads_back_as_its_bytes(nbytes: int) -> None:
    assert size_from_text(size_text(nbytes)) == pytest.approx(nbytes, rel=0.05)
