"""The dying gasp of a surviving node agent: which replicas, which step, the manifest."""
from __future__ import annotations

import json

import pytest

from mindft.exitcodes import ExitCode
from mindft.flow import gasp
from mindft.flow.agent import NodePolicy
from mindft.flow.gasp import Entry, Origin, Plan
from mindft.protocol import JobState as S
from mindft.protocol import JobView


def test_an_orphaned_agent_writes_every_replica_it_keeps() -> None:
    # The controller is gone: its node (0) went with it, and which other node lives cannot be told.
    assert gasp.replicas_to_write({0: 7, 2: 7}, orphaned=True, unreached=()) == [0, 2]


def test_after_the_controller_failed_the_job_only_the_unreached_ranks_replicas_are_written() -> None:
    assert gasp.replicas_to_write({0: 7, 2: 7}, orphaned=False, unreached=(2, 5)) == [2]
    assert gasp.replicas_to_write({0: 7}, orphaned=False, unreached=()) == []


@pytest.mark.parametrize("own, replicas, wanted, step", [
    ({1: (7, 8)}, {0: 8}, -1, 8),     # node 0 lost: its replica and rank 1's newest agree
    ({1: (8, 9)}, {0: 8}, -1, 8),     # rank 1 got one step further: the step both hold
    ({1: (8, 9)}, {0: 8}, 9, 8),      # the job's step is not held by the replica: the common one
    ({1: (8, 9)}, {0: 9}, 8, 9),      # the job's step is not held by the replica either
    ({0: (8, 9)}, {}, 8, 8),          # nothing kept: the job's step
    ({1: (4, 5)}, {0: 8}, -1, -1),    # none common: each its newest, and the manifest says so
])
def test_the_step_is_the_jobs_when_every_source_holds_it_else_the_newest_common(own, replicas, wanted, step) -> None:
    plan = gasp.plan(own, replicas, wanted)
    assert plan.step == step
    assert plan.sources == {**{r: Origin.MEMORY for r in own}, **{r: Origin.REPLICA for r in replicas}}


def test_with_no_common_step_each_source_writes_its_newest() -> None:
    plan = Plan(-1, {1: Origin.MEMORY})
    assert plan.step_of(1, (4, 5)) == 5 and plan.step_of(1, ()) == -1
    assert Plan(4, {}).step_of(1, (4, 5)) == 4


def entries() -> dict[int, Entry]:
    return {0: Entry("mindft-rank0-step8.ckpt", 8, 0, 1, Origin.REPLICA),
            1: Entry("mindft-rank1-step8.ckpt", 8, 1, 1, Origin.MEMORY)}


def test_the_manifest_says_which_node_held_what_and_reads_back() -> None:
    document = json.loads(json.dumps(gasp.manifest(1, 2, entries(), "node 0 lost", 12.5)))
    assert document["format"] == "mindft-dying-gasp" and document["version"] == 1
    assert document["step"] == 8 and document["node"] == 1
    assert document["ranks"]["0"] == {"file": "mindft-rank0-step8.ckpt", "step": 8, "node": 0, "written_by": 1,
                                      "origin": "replica"}
    assert gasp.read_manifest(document) == (8, 2, entries())


def test_a_manifest_of_different_steps_says_so() -> None:
    mixed = {**entries(), 1: Entry("mindft-rank1-step5.ckpt", 5, 1, 1, Origin.RANK)}
    assert gasp.manifest(1, 2, mixed, "", 0.0)["step"] == -1


@pytest.mark.parametrize("document, says", [
    ({"format": "other"}, "not a mindft-dying-gasp manifest"),
    ({"format": "mindft-dying-gasp", "version": 99}, "version 99; this mindft reads version 1"),
    ({"format": "mindft-dying-gasp", "version": 1, "step": 1, "world_size": 2, "ranks": {"0": {"file": "x"}}},
     "malformed"),
])
def test_a_manifest_it_cannot_read_is_refused_saying_why(document, says) -> None:
    with pytest.raises(ValueError, match=says):
        gasp.read_manifest(document)


def test_resuming_takes_the_newest_step_every_rank_has_across_the_nodes_manifests() -> None:
    node0 = (5, 2, {0: Entry("a", 5, 0, 0, Origin.RANK), 1: Entry("b", 5, 1, 0, Origin.REPLICA)})
    node1 = (-1, 2, {1: Entry("c", 6, 1, 1, Origin.RANK), 0: Entry("d", 4, 0, 1, Origin.REPLICA)})
    step, files = gasp.resume_point([node0, node1])
    assert step == 5 and {r: e.file for r, e in files.items()} == {0: "a", 1: "b"}


def test_resuming_without_every_rank_at_one_step_is_refused_naming_what_was_written() -> None:
    alone = (8, 2, {1: Entry("c", 8, 1, 1, Origin.RANK)})
    with pytest.raises(ValueError, match=r"no step has a dying gasp of every rank 0\.\.1: .*\{8: \[1\]\}"):
        gasp.resume_point([alone])
    with pytest.raises(ValueError, match="different sizes"):
        gasp.resume_point([alone, (8, 4, {})])


def test_an_agent_whose_ranks_gave_up_on_the_controller_is_orphaned_and_writes_its_dying_gasp() -> None:
    policy = NodePolicy((1,), max_restarts=2, view=JobView(S.NORMAL))
    assert not policy.orphaned and not policy.writes_dying_gasp
    policy.on_exit(1, ExitCode.DUMPED)  # it never heard that the job ended
    assert policy.orphaned and policy.writes_dying_gasp


def test_an_agent_told_that_the_job_failed_writes_its_dying_gasp_but_is_not_orphaned() -> None:
    policy = NodePolicy((1,), max_restarts=2, view=JobView(S.FAILED, dump_step=8, unreached=(0,)))
    policy.on_exit(1, ExitCode.DUMPED)
    assert not policy.orphaned and policy.writes_dying_gasp


def test_the_agent_running_the_controller_is_never_orphaned_and_a_finished_job_writes_nothing() -> None:
    node0 = NodePolicy((0,), max_restarts=2, runs_controller=True, view=JobView(S.NORMAL))
    node0.on_exit(0, ExitCode.DUMPED)
    assert not node0.orphaned
    done = NodePolicy((1,), max_restarts=2, view=JobView(S.DONE))
    done.on_exit(1, ExitCode.OK)
    assert not done.writes_dying_gasp
