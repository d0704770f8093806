"""The event log: records and their lines, the bounded appender, the timeline, ``mindft events``."""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from mindft.observe import events
from mindft.cli.main import EXIT_CONFIG_ERROR, main
from mindft.observe.events import (CONTROLLER_FILE, ClusterFormed, ControllerFollowed, Event, EventError, EventLog,
                                   EventTail, FaultSeen, JobFinished, JobMoved, LadderDecision, NodeGiven, OrderSent,
                                   ProcessExitRecord, ProcessStartRecord, TookCommand, decode, encode, node_file)
from mindft.observe.timeline import describe, recoveries, render

T0 = 1_800_000_000.0

RECORDS = [JobMoved("NORMAL", "PAUSING", "rank 1 DEVICE_RESET", 1, 8),
           FaultSeen(1, "device_reset", 8, "chip reset", -1, False),
           LadderDecision("restart_all", "restarting every worker"),
           OrderSent(0, "kill", "every worker restarts", 4242, False),
           ProcessStartRecord("worker", 5151, 1, 2, True, ""),
           ProcessExitRecord("scheduler", 77, -9),
           ClusterFormed(78),
           JobFinished(0, "all 2 ranks finished"),
           NodeGiven(1, 1, "node 1's agent and ranks [1] silent for 6.1 s (> 6 s)"),
           TookCommand(1, 0, 1, "node agents [1] of 2 said hello to this standby (at least half)"),
           ControllerFollowed("tcp://10.0.0.1:29601", "tcp://10.0.0.2:29601", 1, 4.2, True)]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.KIND)
def test_every_record_survives_its_line(record: events.Record) -> None:
    event = Event(T0 + 0.25, "controller", record)
    line = encode(event)
    fields = json.loads(line)
    assert fields["kind"] == record.KIND and fields["v"] == events.VERSION and fields["source"] == "controller"
    assert fields["time"] == "2027-01-15T08:00:00.250Z" and fields["at"] == T0 + 0.25
    assert decode(line) == event


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"v": 99, "kind": "finish", "at": 1}', "version 99 is not supported"),
    ('{"v": 1, "kind": "bogus", "at": 1}',
     "unknown event kind 'bogus'; known kinds: cluster_formed, controller_followed, fault, finish"),
    ('{"v": 1, "kind": "finish", "at": 1, "reason": "x"}', "bad finish event"),
])
def test_decode_rejects_what_is_not_an_event(line: str, message: str) -> None:
    with pytest.raises(EventError, match=message):
        decode(line)


def test_the_log_rotates_once_at_its_bound(tmp_path: Path) -> None:
    path = tmp_path / CONTROLLER_FILE
    log = EventLog(path, "controller", max_bytes=2000)
    for n in range(100):
        log.append(JobFinished(n, "x" * 20), at=T0 + n)
    older = path.with_name(path.name + ".1")
    assert path.stat().st_size <= 2000 and older.stat().st_size <= 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONTROLLER_FILE, CONTROLLER_FILE + ".1"]
    kept = events.read(tmp_path)
    assert [e.record.exit_code for e in kept] == list(range(100 - len(kept), 100))  # the newest, in order


def test_threads_append_whole_lines(tmp_path: Path) -> None:
    log = EventLog(tmp_path / node_file(3), "node 3")

    def write(rank: int) -> None:
        for n in range(200):
            log.append(ProcessStartRecord("worker", n, rank))
    threads = [threading.Thread(target=write, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = (tmp_path / "events-node3.jsonl").read_text().splitlines()
    assert len(lines) == 800 and all(decode(line).source == "node 3" for line in lines)


def test_an_unwritable_log_drops_events_without_failing(tmp_path: Path) -> None:
    EventLog(tmp_path / "missing" / CONTROLLER_FILE, "controller").append(JobFinished(0, "done"))
    assert not (tmp_path / "missing").exists()


def test_the_tail_reads_complete_lines_once(tmp_path: Path) -> None:
    tail = EventTail(tmp_path)
    assert tail.poll() == []
    path = tmp_path / CONTROLLER_FILE
    first = encode(Event(T0, "controller", JobFinished(0, "a")))
    path.write_text(first + "\n" + first[:10])  # a line being written
    assert [e.record.reason for e in tail.poll()] == ["a"]
    path.write_text(first + "\n" + first.replace('"a"', '"b"') + "\n")
    assert [e.record.reason for e in tail.poll()] == ["b"]
    assert tail.poll() == []


def hot_reset_log() -> list[Event]:
    """What the controller and node 0 write for a hot reset of rank 1 (restart every worker), then a crash."""
    c, n = "controller", "node 0"
    return [Event(T0 + at, source, record) for at, source, record in [
        (0.0, n, ProcessStartRecord("scheduler", 10)),
        (0.1, n, ProcessStartRecord("worker", 11, 0)),
        (0.1, n, ProcessStartRecord("worker", 12, 1)),
        (1.0, c, JobMoved("STARTING", "NORMAL", "all 2 ranks registered")),
        (5.0, c, JobMoved("NORMAL", "PAUSING", "rank 1 DEVICE_RESET; restarting every worker", 1, 8)),
        (5.0, c, FaultSeen(1, "device_reset", 8, "chip 1 unrecovered")),
        (5.0, c, FaultSeen(0, "device_reset", 8, "", collateral=True)),
        (5.0, c, LadderDecision("restart_all", "rank 1 DEVICE_RESET; restarting every worker")),
        (5.1, c, OrderSent(0, "kill", "every worker restarts", 11)),
        (5.1, c, OrderSent(1, "kill", "every worker restarts", 12)),
        (5.2, n, ProcessExitRecord("worker", 11, -9, 0)),
        (5.3, n, ProcessExitRecord("worker", 12, -9, 1)),
        (5.4, c, JobMoved("PAUSING", "REPAIRING", "every live rank paused", 1, 8)),
        (6.0, n, ProcessStartRecord("scheduler", 20)),
        (6.1, n, ProcessStartRecord("worker", 21, 0, 1, True)),
        (6.2, n, ProcessStartRecord("worker", 22, 1, 1, False, "the warm path fell back to a cold start")),
        (6.5, n, ClusterFormed(20)),
        (7.0, c, JobMoved("REPAIRING", "ROLLBACK", "every rank holds step 8", 1, 8)),
        (7.5, c, JobMoved("ROLLBACK", "RESUMING", "every rank restored step 8", 1, 8)),
        (7.75, c, JobMoved("RESUMING", "NORMAL", "every rank resumed after step 8", 1, 8)),
        (9.0, n, ProcessExitRecord("worker", 21, 1, 0)),  # a crash of the training script
        (9.1, c, JobMoved("NORMAL", "PAUSING", "rank 0 PROCESS_DIED", 2, 12)),
        (9.1, c, FaultSeen(0, "process_died", 12, "process 21 exited with code 1")),
        (9.1, c, LadderDecision("in_place", "rank 0 PROCESS_DIED")),
        (9.2, c, JobMoved("PAUSING", "FAILED", "timeouts.pause passed", 2, 12)),
        (9.2, c, LadderDecision("dying_gasp", "timeouts.pause passed")),
        (9.3, c, JobFinished(1, "timeouts.pause passed")),
    ]]


def test_the_timeline_groups_events_into_recoveries_with_their_phases() -> None:
    first, second = recoveries(hot_reset_log())
    assert first.outcome == "recovered" and first.rung == "restart_all"
    assert first.start == T0 + 5.0 and first.total == pytest.approx(2.75)
    assert first.phases == pytest.approx({"pause": 0.4, "repair": 1.6, "rollback": 0.5, "resume": 0.25}, abs=1e-6)
    assert [(round(at - first.start, 2), what) for at, what in first.marks] == [
        (0.0, "fault: rank 1 device_reset at step 8: chip 1 unrecovered"),
        (0.0, "ladder: every worker restarts from the agents' memory"),
        (0.1, "first kill ordered: rank 0"),
        (0.1, "last of 2 kills ordered: rank 1"),
        (0.2, "first worker exited: rank 0 (killed by signal 9)"),
        (0.3, "last of 2 worker exits: rank 1 (killed by signal 9)"),
        (0.4, "every rank paused"),
        (1.0, "new MindSpore scheduler started"),
        (1.1, "first worker started: rank 0 (warm)"),
        (1.2, "last of 2 worker starts: rank 1 (cold)"),
        (1.5, "MindSpore's cluster formed (init() returns on the ranks)"),
        (2.0, "every rank holds the rollback step (repaired)"),
        (2.5, "every rank restored the rollback step"),
        (2.75, "training resumed")]
    # The second began with the exit the agent saw before the controller heard of it.
    assert second.outcome == "failed" and second.rung == "dying_gasp"
    assert second.start == T0 + 9.0 and second.total == pytest.approx(0.2)
    assert second.phases == pytest.approx({"detect": 0.1, "pause": 0.1}, abs=1e-6)
    assert [what for _, what in second.marks][:2] == ["worker exited: rank 0 (exit code 1)",
                                                      "fault: rank 0 process_died at step 12: process 21 exited "
                                                      "with code 1"]


def test_a_recovery_in_progress_has_no_end() -> None:
    (recovery,) = recoveries(hot_reset_log()[:15])
    assert recovery.outcome == "in progress" and recovery.total is None
    assert render(recovery)[0] == "recovery 1: device_reset on rank 1; restart all; in progress"


def test_render_prints_seconds_after_the_fault() -> None:
    lines = render(recoveries(hot_reset_log())[0], 1)
    assert lines[0] == "recovery 1: device_reset on rank 1; restart all; recovered in 2.75s"
    assert "     0.40  every rank paused" in lines and "     2.75  training resumed" in lines
    assert lines[-1] == "  phases: pause 0.40s, repair 1.60s, rollback 0.50s, resume 0.25s; total 2.75s"


@pytest.mark.parametrize("record, text", [
    (RECORDS[0], "NORMAL → PAUSING: rank 1 DEVICE_RESET"),
    (RECORDS[3], "order: kill rank 0 (pid 4242): every worker restarts"),
    (RECORDS[4], "node 0: rank 1 started (pid 5151, warm, restart 2)"),
    (RECORDS[5], "node 0: scheduler (pid 77) killed by signal 9"),
    (ClusterFormed(78), "node 0: MindSpore's cluster formed (scheduler pid 78)"),
    (FaultSeen(-1, "scheduler_lost", 3, "", node=-1), "fault: MindSpore's scheduler scheduler_lost at step 3"),
    (RECORDS[8], "node 1 given to a warm spare (adoption 1): node 1's agent and ranks [1] silent for 6.1 s (> 6 s)"),
    (RECORDS[9], "the standby controller on node 1 took command: term 0 → 1 (node agents [1] of 2 said hello to "
                 "this standby (at least half))"),
    (RECORDS[10], "node 0: the controller at tcp://10.0.0.1:29601 said nothing for 4.2 s; following the standby "
                  "at tcp://10.0.0.2:29601 (term 1, this node)"),
])
def test_describe(record: events.Record, text: str) -> None:
    assert describe(Event(T0, "node 0", record)) == text


def write_run(run_dir: Path, log: list[Event]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for source, name in (("controller", CONTROLLER_FILE), ("node 0", node_file(0))):
        with open(run_dir / name, "w") as handle:
            handle.writelines(encode(e) + "\n" for e in log if e.source == source)


def test_mindft_events_prints_every_recovery_of_a_finished_job(tmp_path: Path) -> None:
    write_run(tmp_path / "run", hot_reset_log())
    # job.json is gone after the job: its path, or the run directory, still finds the log.
    for job in (tmp_path / "run" / "job.json", tmp_path / "run"):
        result = CliRunner().invoke(main, ["events", "--job", str(job)])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0] == "recovery 1: device_reset on rank 1; restart all; recovered in 2.75s"
        assert "recovery 2: process_died on rank 0; dying gasp; failed in 0.20s" in lines
        assert lines[-1] == "job finished: exit code 1: timeouts.pause passed"


def test_mindft_events_json_prints_the_raw_events(tmp_path: Path) -> None:
    log = hot_reset_log()
    write_run(tmp_path, log)
    result = CliRunner().invoke(main, ["events", "--job", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    printed = [decode(line) for line in result.output.splitlines()]
    assert printed == sorted(log, key=lambda e: e.at)


def test_mindft_events_follow_ends_with_the_job(tmp_path: Path) -> None:
    write_run(tmp_path, hot_reset_log())
    result = CliRunner().invoke(main, ["events", "--job", str(tmp_path / "job.json"), "--follow"])
    assert result.exit_code == 0, result.output
    assert "08:00:05.000  NORMAL → PAUSING: rank 1 DEVICE_RESET; restarting every worker" in result.output
    assert "recovery 1: device_reset on rank 1; restart all; recovered in 2.75s" in result.output
    assert result.output.rstrip().endswith("job finished: exit code 1: timeouts.pause passed")


def test_mindft_events_without_a_log(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["events", "--job", str(tmp_path), "--json"])
    assert result.exit_code == EXIT_CONFIG_ERROR
    error = json.loads(result.output)
    assert error["input"] == "--job" and "no event log in" in error["error"]
    result = CliRunner().invoke(main, ["events", "--job", str(tmp_path / "nowhere" / "job.json")])
    assert result.exit_code == EXIT_CONFIG_ERROR and "no such run directory" in result.output


def test_records_are_frozen_dataclasses_with_a_kind() -> None:
    for cls in events.RECORDS.values():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert "KIND" not in {f.name for f in dataclasses.fields(cls)}


def test_the_scheduler_logs_its_formed_cluster_once_reading_only_new_bytes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from mindft.agent.workers import CLUSTER_FORMED_LINE, Scheduler

    log = EventLog(tmp_path / "events-node0.jsonl", "node 0")
    scheduler = Scheduler(SimpleNamespace(log_dir=tmp_path), events=log)
    head, rest = CLUSTER_FORMED_LINE[:9], CLUSTER_FORMED_LINE[9:]
    scheduler.log_path.write_text("[WARNING] BuildCluster] Topology build timed out., retry(1/240).\n" + head)
    assert not scheduler.cluster_formed()
    with open(scheduler.log_path, "a") as appended:  # the line completed after the first read
        appended.write(rest + ".\n")
    assert scheduler.cluster_formed() and scheduler.cluster_formed()
    log.close()
    assert [e.kind for e in events.read(tmp_path)] == ["cluster_formed"]


def test_the_timeline_takes_the_controllers_detect_figure_the_one_its_log_says() -> None:
    """The controller logs ``detect 0.27 s`` (from the fault to the recovery's start, as it measured
    it); ``mindft events`` says the same, not a figure of its own."""
    log = [Event(T0 + 1.0, "node 0", ProcessExitRecord("worker", 21, -9, 1)),
           Event(T0 + 1.2, "controller", JobMoved("NORMAL", "PAUSING", "rank 1 PROCESS_DIED in step 5", 1, 4,
                                                   detect=0.27)),
           Event(T0 + 1.2, "controller", FaultSeen(1, "process_died", 5, "process 21 exited with code -9")),
           Event(T0 + 2.0, "controller", JobMoved("PAUSING", "NORMAL", "recovered", 1, 4))]
    (recovery,) = recoveries(log)
    assert recovery.phases["detect"] == pytest.approx(0.27) and recovery.start == pytest.approx(T0 + 1.2 - 0.27)
    assert "detect 0.27s" in render(recovery)[-1]


def test_mindft_events_prints_the_finished_jobs_goodput(tmp_path: Path) -> None:
    seconds = {"productive": 54.0, "start-up": 4.0, "snapshots": 0.5, "pause": 0.2, "repair": 1.0, "rollback": 0.1,
               "resume": 0.0, "replayed": 0.2}
    write_run(tmp_path / "run", [Event(T0, "controller", JobMoved("STARTING", "NORMAL", "all 2 ranks registered")),
                                 Event(T0 + 60, "controller", JobFinished(0, "all 2 ranks finished", seconds))])
    result = CliRunner().invoke(main, ["events", "--job", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == ("goodput: 90.0% of 60.0 s productive (54.0 s); the rest: start-up 4.0 s, "
                                              "snapshots 0.5 s, pause 0.2 s, repair 1.0 s, rollback 0.1 s, "
                                              "replayed 0.2 s")
