"""The MindSpore adapter in one process: state capture/restore, the optimizer hook, pass-through.

Training runs in this process (PyNative, CPU); where a controller is needed it runs on
a thread with a free port and the rank talks to it over real ZeroMQ on 127.0.0.1.
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402
from mindspore.train import Model  # noqa: E402

from mindft.config import MindftConfig, TFTOptions, Timeouts  # noqa: E402
from mindft.controller import Controller  # noqa: E402
from mindft.exitcodes import ExitCode  # noqa: E402
from mindft.mindspore import FaultTolerance, FaultTolerantLoop  # noqa: E402
from mindft.mindspore._session import TrainingState  # noqa: E402
from mindft.net import channel  # noqa: E402
from mindft.protocol import FaultKind, InjectRequest, Reply  # noqa: E402
from mindft.snapshot.store import SnapshotStore  # noqa: E402

from harness import EXAMPLES, assert_identical, start_controller  # noqa: E402

sys.path.insert(0, str(EXAMPLES))
import train_mlp  # noqa: E402

pytestmark = [pytest.mark.mindspore, pytest.mark.compat, pytest.mark.timeout(120)]
FAST = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=20.0, pause=20.0, repair=20.0,
                rollback=20.0, resume=20.0, connect_retries=10)


class Trainer:
    """The example's MLP with a pynative (or jit) train step over fixed batches."""

    def __init__(self, jit: bool = False) -> None:
        train_mlp.configure_mindspore()
        self.net, self.optimizer = train_mlp.build(seed=3)
        self.x, self.y = train_mlp.synthetic_shard(3, 0, 1, 64)
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

        def forward(xb: ms.Tensor, yb: ms.Tensor) -> ms.Tensor:
            return loss_fn(self.net(xb), yb)
        grad_fn = ms.value_and_grad(forward, None, self.optimizer.parameters)

        def step(xb: ms.Tensor, yb: ms.Tensor) -> ms.Tensor:
            loss, grads = grad_fn(xb, yb)
            self.optimizer(grads)
            return loss
        self.train_step: Callable = ms.jit(step) if jit else step

    def batch(self, step: int) -> tuple[ms.Tensor, ms.Tensor]:
        start = (step - 1) % 4 * 16
        return ms.Tensor(self.x[start:start + 16]), ms.Tensor(self.y[start:start + 16])

    def state(self) -> dict[str, np.ndarray]:
        return {p.name: p.asnumpy().copy() for p in (*self.net.get_parameters(), *self.optimizer.get_parameters())}

    def plain(self, steps: int) -> dict[str, np.ndarray]:
        for step in range(1, steps + 1):
            self.train_step(*self.batch(step))
        return self.state()


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return Trainer().plain(10)


@pytest.fixture
def controller(request) -> Iterator[tuple[Controller, MindftConfig]]:
    # A snapshot every step (these tests check its mechanics), or the budget's cadence.
    every = getattr(request, "param", {"snapshot_every": 1})
    ctl, config = start_controller(MindftConfig(tft=TFTOptions(uce=True), controller_port=0, insecure=True,
                                                timeouts=FAST, **every))
    yield ctl, config
    ctl.stop()


def test_restore_puts_back_weights_and_optimizer_moments_in_place(reference) -> None:
    trainer = Trainer()
    state = TrainingState(trainer.net, trainer.optimizer)
    assert state.aliased  # CPU: asnumpy() is a view, restore writes the live parameters
    trainer.plain(6)
    at_six = trainer.state()
    with SnapshotStore() as store:
        store.capture(6, state.arrays(), {"step": 6})
        store.wait()
        for step in (7, 8):  # moves weights, moments, beta powers and global_step
            trainer.train_step(*trainer.batch(step))
        assert trainer.state()["moment1.0.weight"].tobytes() != at_six["moment1.0.weight"].tobytes()
        meta = state.load(store, 6)
    assert meta["step"] == 6
    assert_identical(trainer.state(), at_six)
    for step in range(7, 11):  # replay: the run ends exactly where the uninterrupted one did
        trainer.train_step(*trainer.batch(step))
    assert_identical(trainer.state(), reference)


def test_mindft_off_is_a_pass_through(reference) -> None:
    trainer = Trainer()
    with FaultTolerantLoop(trainer.net, trainer.optimizer, MindftConfig()) as loop:
        for step, batch in loop.batches(trainer.batch, 10):
            loop.step(trainer.train_step, *batch)
        assert loop.session.processor is None and loop.session.store is None
        assert loop.position == 10
    assert_identical(trainer.state(), reference)


@pytest.mark.parametrize("jit", [False, True])
def test_capture_overlaps_in_pynative_and_falls_back_to_synchronous_under_jit(controller, reference,
                                                                              jit: bool) -> None:
    ctl, config = controller
    trainer = Trainer(jit=jit)
    with FaultTolerantLoop(trainer.net, trainer.optimizer, config) as loop:
        for step, batch in loop.batches(trainer.batch, 10):
            loop.step(trainer.train_step, *batch)
            # Under jit the optimizer's pre-hook never runs, so the copy must not be left in flight.
            assert loop.session.overlap is not jit
        loop.session.store.wait()  # in PyNative the last capture may still be in flight
        assert loop.session.store.steps == (9, 10)
    assert_identical(trainer.state(), reference)
    assert ctl.join(10).exit_code == ExitCode.OK


@pytest.mark.parametrize("controller", [{"overhead_budget": 0.0001, "max_replay_steps": 3}], indirect=True)
def test_the_session_reports_its_costs_and_follows_the_budget_cadence(controller) -> None:
    # A budget of 0.01% asks for a snapshot far less often than 3 steps allow: the cadence the
    # controller announces is every 3rd step, and the rank snapshots on it.
    ctl, config = controller
    trainer = Trainer()
    with FaultTolerantLoop(trainer.net, trainer.optimizer, config) as loop:
        for step, batch in loop.batches(trainer.batch, 30):
            loop.step(trainer.train_step, *batch)
        loop.session.store.wait()
        schedule = loop.session.processor.follower.schedule
        assert schedule.segments[-1][1] == 3 and schedule.segments[-1][0] <= 24, schedule
        assert loop.session.store.steps == tuple(sorted(schedule.held_after(30))), schedule
        assert loop.session.costs.step_time > 0 and loop.session.costs.capture_time > 0
    assert_identical(trainer.state(), Trainer().plain(30))
    assert ctl.join(10).exit_code == ExitCode.OK
    assert ctl.job.tuner.schedule == schedule


def test_fault_injected_by_the_controller_is_recovered(controller, reference) -> None:
    ctl, config = controller
    trainer = Trainer()
    replies = []

    def batch(step: int) -> tuple[ms.Tensor, ms.Tensor]:
        if step == 4 and not replies:
            replies.append(channel.request(config.controller_address, None, InjectRequest(0, FaultKind.DEVICE_RESET, "test")))
        return trainer.batch(step)

    with FaultTolerantLoop(trainer.net, trainer.optimizer, config) as loop:
        results = [loop.step(trainer.train_step, *b) for _, b in loop.batches(batch, 10)]
    assert isinstance(replies[0], Reply) and replies[0].ok
    assert results.count(None) == 1  # exactly one step raised (the injected DeviceFault) and was replayed
    assert_identical(trainer.state(), reference)
    result = ctl.join(10)
    assert result.exit_code == ExitCode.OK and len(ctl.recovery_times) == 1


def test_callback_alone_protects_model_train(controller) -> None:
    """FaultTolerance passed to Model.train itself: registers, reports every step, reports Done."""
    import mindspore.dataset as ds

    ctl, config = controller
    trainer = Trainer()

    class Source:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
            return tuple(t.asnumpy() for t in trainer.batch(index + 1))

    model = Model(trainer.net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), trainer.optimizer)
    ft = FaultTolerance(config)
    model.train(2, ds.GeneratorDataset(Source(), ["x", "y"], shuffle=False), callbacks=[ft],
                dataset_sink_mode=False)
    result = ctl.join(10)
    assert result is not None and result.exit_code == ExitCode.OK, result
    assert ctl.latest_status().step == 8
    assert_identical(trainer.state(), Trainer().plain(8))  # 2 epochs of 4 batches == 8 plain steps


def test_train_takes_every_parameter_model_train_takes() -> None:
    import inspect

    from mindft.mindspore import train
    ours = inspect.signature(train).parameters
    for name, parameter in inspect.signature(Model.train).parameters.items():
        if name != "self":
            assert name in ours and ours[name].default == parameter.default, name


def _batches(trainer: Trainer):
    import mindspore.dataset as ds

    class Source:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
            return tuple(t.asnumpy() for t in trainer.batch(index + 1))
    return ds.GeneratorDataset(Source(), ["x", "y"], shuffle=False)


@pytest.mark.parametrize("keywords", [
    dict(dataset_sink_mode=True, sink_size=1),   # Model.train does not sink on CPU: accepted
    dict(dataset_sink_mode=True),                 # the whole epoch per sink: the same on CPU
    dict(initial_epoch=1),
], ids=["sink-size-1", "sink-epoch", "initial-epoch"])
def test_train_with_model_train_keywords_is_protected_and_equals_model_train(controller, keywords) -> None:
    from mindft.mindspore import train
    ctl, config = controller
    protected, plain = Trainer(), Trainer()
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    steps = train(Model(protected.net, loss, protected.optimizer), epoch=2, train_dataset=_batches(protected),
                  config=config, **keywords)
    Model(plain.net, loss, plain.optimizer).train(2, _batches(plain), **keywords)
    result = ctl.join(10)
    assert result is not None and result.exit_code == ExitCode.OK, result
    assert steps == ctl.latest_status().step == (4 if keywords.get("initial_epoch") else 8)
    assert_identical(protected.state(), plain.state())


def test_a_rollback_keeps_the_datasets_own_skip_and_the_callbacks_step_count(controller) -> None:
    """A dataset that skips its first batches (MindFormers' resume: set_init_step) and a fault in
    the middle: the same steps as Model.train, and the callbacks see one training whose step count
    goes on from the restored step, as in a run without the fault."""
    from mindspore.train import Callback

    from mindft.mindspore import train
    ctl, config = controller
    protected, plain = Trainer(), Trainer()
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    class Watch(Callback):
        def __init__(self, fault_at: int = 0) -> None:
            self.fault_at, self.ends = fault_at, []

        def on_train_step_begin(self, run_context) -> None:
            if run_context.original_args().cur_step_num == self.fault_at:
                self.fault_at = 0
                assert channel.request(config.controller_address, None,
                                       InjectRequest(0, FaultKind.DEVICE_RESET, "test")).ok

        def on_train_end(self, run_context) -> None:
            self.ends.append(run_context.original_args().cur_step_num)

    protected_data, plain_data = _batches(protected), _batches(plain)
    protected_data.set_init_step(3)
    plain_data.set_init_step(3)
    watched, unwatched = Watch(fault_at=5), Watch()
    steps = train(Model(protected.net, loss, protected.optimizer), 3, protected_data, [watched], config=config)
    Model(plain.net, loss, plain.optimizer).train(3, plain_data, callbacks=[unwatched])
    result = ctl.join(10)
    assert result is not None and result.exit_code == ExitCode.OK and len(ctl.recovery_times) == 1, result
    assert steps == 9 and watched.ends == unwatched.ends == [9]  # 3 epochs of 4 batches, less the 3 skipped
    assert_identical(protected.state(), plain.state())


@pytest.mark.parametrize("device, pynative, keywords, refused", [
    ("Ascend", False, dict(dataset_sink_mode=True), "a whole epoch per call"),
    ("Ascend", False, dict(dataset_sink_mode=True, sink_size=1), "1 steps per call"),
    ("Ascend", False, dict(dataset_sink_mode=False), ""),
    ("Ascend", True, dict(dataset_sink_mode=True), ""),
    ("CPU", False, dict(dataset_sink_mode=True, sink_size=4), ""),
])
def test_a_sinking_dataset_is_refused_with_what_to_change(device, pynative, keywords, refused) -> None:
    from mindft.mindspore.callback import sink_problem
    problem = sink_problem(keywords["dataset_sink_mode"], keywords.get("sink_size", -1), device, pynative)
    assert (refused in problem and "pass dataset_sink_mode=False" in problem) if refused else problem == ""


def test_train_refuses_an_initial_epoch_past_the_last() -> None:
    from mindft.mindspore import train
    trainer = Trainer()
    model = Model(trainer.net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), trainer.optimizer)
    with pytest.raises(ValueError, match="initial_epoch must be in 0..1"):
        train(model, 2, _batches(trainer), initial_epoch=2, config=MindftConfig())


GRAPH_MODE_RUN = """
import dataclasses, sys
sys.path.insert(0, {examples!r})
import mindspore as ms
ms.set_context(mode=ms.GRAPH_MODE)
import mindspore.dataset as ds
from mindspore import nn
from mindspore.train import Model
import train_mlp, train_model
import mindft.mindspore
from mindft.config import MindftConfig, TFTOptions
from mindft.controller import Controller

train_mlp.configure_mindspore()
config = MindftConfig(tft=TFTOptions(uce=True), controller_port=0, insecure=True)
controller = Controller(config)
controller.start()
config = dataclasses.replace(config, controller_port=int(controller.endpoint.rsplit(":", 1)[1]))
x, y = train_mlp.synthetic_shard(1, 0, 1, 64)

def run(cfg):
    net, opt = train_mlp.build(1)
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), opt)
    data = ds.GeneratorDataset(train_model.Batches(x, y, 16), ["x", "y"], shuffle=False)
    mindft.mindspore.train(model, 2, data, config=cfg)
    return {{p.name: p.asnumpy().tobytes() for p in (*net.get_parameters(), *opt.get_parameters())}}

protected = run(config)
result = controller.join(20)
assert result is not None and result.exit_code == 0 and controller.latest_status().step == 8, result
assert protected == run(MindftConfig()), "graph-mode weights differ from the unprotected run"
print("GRAPH MODE OK")
"""


def test_model_train_in_graph_mode_snapshots_synchronously() -> None:
    """Graph mode compiles Cell hooks into the graph: the adapter must not install one there."""
    import subprocess

    examples = str(EXAMPLES)
    done = subprocess.run([sys.executable, "-c", GRAPH_MODE_RUN.format(examples=examples)],
                          capture_output=True, text=True, timeout=100)
    assert "GRAPH MODE OK" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.mark.parametrize("jit", [False, True])
def test_lockstep_waits_before_the_collectives_not_at_the_step_end(controller, reference, monkeypatch,
                                                                   jit: bool) -> None:
    # A job with collectives: the rank waits for its peers' previous step in the network's
    # forward hook (overlapped with the step), not at the step's end; under jit the hook never
    # runs, and the rank falls back to waiting at the step's end.
    import mindft.mindspore._session as session_module

    monkeypatch.setattr(session_module, "uses_collectives", lambda: True)
    ctl, config = controller
    trainer = Trainer(jit=jit)
    with FaultTolerantLoop(trainer.net, trainer.optimizer, config) as loop:
        assert loop.session.loop.lockstep is False and loop.session._gate is not None
        for step, batch in loop.batches(trainer.batch, 10):
            loop.step(trainer.train_step, *batch)
            assert loop.session.loop.lockstep is jit
            assert (loop.session._gate is None) is jit
    assert_identical(trainer.state(), reference)
    assert ctl.join(10).exit_code == ExitCode.OK


def test_an_action_before_the_collectives_interrupts_the_step_and_it_is_replayed(controller, reference,
                                                                                  monkeypatch) -> None:
    # The controller's action is pending when step 4 reaches its gate: the step is abandoned
    # there (nothing applied), the rank follows the action (an injected fault, armed), replays
    # step 4, which raises the armed fault at its start and is recovered; the run ends as the
    # uninterrupted one.
    import mindft.mindspore._session as session_module

    monkeypatch.setattr(session_module, "uses_collectives", lambda: True)
    ctl, config = controller
    trainer = Trainer()
    replies: list = []

    def batch(step: int) -> tuple[ms.Tensor, ms.Tensor]:
        if step == 4 and not replies:
            replies.append(channel.request(config.controller_address, None,
                                           InjectRequest(0, FaultKind.DEVICE_RESET, "test")))
            processor = loop.session.processor
            with processor._cond:
                processor._cond.wait_for(lambda: processor._actions, timeout=10)
            assert processor._actions, "the injected action did not arrive"
        return trainer.batch(step)

    with FaultTolerantLoop(trainer.net, trainer.optimizer, config) as loop:
        results = [loop.step(trainer.train_step, *b) for _, b in loop.batches(batch, 10)]
    assert isinstance(replies[0], Reply) and replies[0].ok
    assert results.count(None) == 2  # step 4 interrupted at its gate, then its replay raised the armed fault
    assert_identical(trainer.state(), reference)
    result = ctl.join(10)
    assert result.exit_code == ExitCode.OK and len(ctl.recovery_times) == 1
