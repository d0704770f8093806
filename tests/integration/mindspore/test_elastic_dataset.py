"""``Model.train``'s elastic dataset (mindft.mindspore.elastic_dataset) in one process: each step
trains on this rank's share of the GlobalBatches stream, across epochs, a resume inside an epoch
and a rollback that re-enters Model.train; what an elastic job refuses. A controller runs on a
thread and the rank talks to it over real ZeroMQ on 127.0.0.1."""
from __future__ import annotations

import logging
import sys
from typing import Iterator

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from mindft.config import MindftConfig, TFTOptions, Timeouts  # noqa: E402
from mindft.controller import Controller  # noqa: E402
from mindft.exitcodes import ExitCode  # noqa: E402
from mindft.mindspore import FaultTolerance, GlobalBatches, elastic_dataset, train  # noqa: E402
from mindft.net import channel  # noqa: E402
from mindft.protocol import FaultKind, InjectRequest  # noqa: E402

from harness import EXAMPLES, assert_identical, start_controller  # noqa: E402

sys.path.insert(0, str(EXAMPLES))
import train_mlp  # noqa: E402

pytestmark = [pytest.mark.mindspore, pytest.mark.compat, pytest.mark.timeout(120)]
FAST = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=20.0, pause=20.0, repair=20.0,
                rollback=20.0, resume=20.0, connect_retries=10)
SAMPLES, GLOBAL_BATCH, FEATURES = 50, 8, 4  # 6 steps a Model.train epoch; the stream carries 2 samples over
DATA = GlobalBatches(SAMPLES, GLOBAL_BATCH, seed=5)
X = np.random.default_rng(5).standard_normal((SAMPLES, FEATURES)).astype(np.float32)
Y = (X.sum(axis=1) > 0).astype(np.int32)
LOSS = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def network() -> tuple[nn.Cell, nn.Optimizer]:
    # The device first, once per process (MindSpore 2.7-2.9 refuse it after a kernel ran: this
    # module may share a process with the adapter's tests).
    train_mlp.configure_mindspore()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(5)
    net = nn.Dense(FEATURES, 2)
    return net, nn.Adam(net.trainable_params(), learning_rate=1e-2)


def load(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return X[indices], Y[indices]


class Steps(Callback):
    """Records the samples of every step (found from its rows) and faults once at ``fault_at``."""

    def __init__(self, config: MindftConfig, fault_at: int = 0) -> None:
        self.config, self.fault_at, self.trained = config, fault_at, {}
        self.rows = {row.tobytes(): index for index, row in enumerate(X)}

    def on_train_step_begin(self, run_context) -> None:
        if run_context.original_args().cur_step_num + 1 == self.fault_at:
            self.fault_at = 0
            assert channel.request(self.config.controller_address, None,
                                   InjectRequest(0, FaultKind.DEVICE_RESET, "test")).ok

    def on_train_step_end(self, run_context) -> None:
        params = run_context.original_args()
        rows = params.train_dataset_element[0].asnumpy()
        self.trained[params.cur_step_num] = [self.rows[row.tobytes()] for row in rows]


@pytest.fixture
def controller() -> Iterator[tuple[Controller, MindftConfig]]:
    ctl, config = start_controller(MindftConfig(tft=TFTOptions(uce=True), controller_port=0, insecure=True,
                                                timeouts=FAST, snapshot_every=1))
    yield ctl, config
    ctl.stop()


def plain(steps: range) -> dict[str, np.ndarray]:
    """The same steps in a plain loop over the stream's global batches: the state to match."""
    net, optimizer = network()
    grad_fn = ms.value_and_grad(lambda x, y: LOSS(net(x), y), None, optimizer.parameters)
    for step in steps:
        _, grads = grad_fn(*(ms.Tensor(a) for a in load(DATA.batch(step))))
        optimizer(grads)
    return {p.name: p.asnumpy() for p in (*net.get_parameters(), *optimizer.get_parameters())}


def test_each_step_trains_its_share_of_the_stream_across_epochs_a_resume_and_a_rollback(controller) -> None:
    """Resumed at step 4 (epoch 0, batch 4), 3 epochs of 6 steps, a fault at step 9 (the next epoch):
    steps 5..18 train the stream's global batches 5..18, the rollback's re-entry included, and the
    weights equal a plain loop over those batches."""
    ctl, config = controller
    net, optimizer = network()
    dataset = elastic_dataset(DATA, load, ["x", "y"], config=config)
    dataset.set_init_step(4)  # a resume inside the first epoch, as MindFormers' does
    steps = Steps(config, fault_at=9 - 4)
    trained = train(Model(net, LOSS, optimizer), 3, dataset, [steps], config=config)
    result = ctl.join(10)
    assert result is not None and result.exit_code == ExitCode.OK and len(ctl.recovery_times) == 1, result
    assert trained == 14 and dataset.get_dataset_size() == 6
    assert steps.trained == {s: DATA.batch(4 + s).tolist() for s in range(1, 15)}
    assert_identical({p.name: p.asnumpy() for p in (*net.get_parameters(), *optimizer.get_parameters())},
                     plain(range(5, 19)))  # the resumed run loads no state: from the initial weights


@pytest.mark.parametrize("rank, world", [(0, 3), (2, 3)])
def test_a_rank_trains_its_share_and_an_uneven_world_says_its_rule(rank, world, caplog) -> None:
    config = MindftConfig(rank=rank, world_size=world)
    with caplog.at_level(logging.WARNING, logger="mindft.mindspore.data"):
        dataset = elastic_dataset(DATA, load, ["x", "y"], config=config)
    assert "a global batch of 8 over 3 ranks: ranks 0..1 take 3 samples and the others 2" in caplog.text
    rows = [x for x, _ in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True)]
    assert [len(x) for x in rows] == [3 if rank < 2 else 2] * 6
    assert np.array_equal(rows[1], X[DATA.share(2, rank, world).indices])


def test_an_elastic_job_refuses_a_plain_dataset_and_model_train_itself() -> None:
    import mindspore.dataset as ds

    config = MindftConfig(tft=TFTOptions(uce=True), elastic_min=2, elastic_max=3)
    net, optimizer = network()
    plain_data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False).batch(8)
    with pytest.raises(ValueError, match="build it with mindft.mindspore.elastic_dataset"):
        train(Model(net, LOSS, optimizer), 1, plain_data, config=config)
    with pytest.raises(ValueError, match="only mindft.mindspore.train can follow"):
        FaultTolerance(config).attach(net, optimizer)


def test_an_elastic_job_reads_the_parallel_context_mindspore_trains_in() -> None:
    """The refusal reads MindSpore's own auto-parallel context (what the network really trains in)."""
    from mindft.mindspore._session import elastic_problem

    config = MindftConfig(tft=TFTOptions(uce=True), elastic_min=2, elastic_max=3)
    try:
        ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
        assert "parallel_mode is semi_auto_parallel" in elastic_problem(config)
        ms.set_auto_parallel_context(parallel_mode="data_parallel", enable_parallel_optimizer=True)
        assert "cannot shard the optimizer state" in elastic_problem(config)
        ms.set_auto_parallel_context(enable_parallel_optimizer=False)
        assert elastic_problem(config) == ""
    finally:
        ms.reset_auto_parallel_context()
