"""Everything mindft reads from the environment, parsed once into frozen dataclasses.

This is the only module that validates configuration: every other module takes
a :class:`MindftConfig` (or one of its parts) and trusts it. It only parses: no disk, no
subprocess, no mindft module below it; what needs either (the key file, the mindio_ttp
wheel, the backend choice, ATO statistics) is in :mod:`mindft.preflight`.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, TypeVar

log = logging.getLogger(__name__)

TFT_VARIABLE = "MS_ENABLE_TFT"
MINDX_TASK_VARIABLE = "MINDX_TASK_ID"  # set by MindCluster when it runs MindIO's controller
STEP_GATE_VARIABLE = "MINDFT_STEP_GATE"  # node 0's step gate, for MindIO's ranks (set by mindft-launch)
DEFAULT_RESET_FILE = Path("/user/restore/reset/config/reset.json")
DEFAULT_CONTROLLER_PORT = 29600
BACKENDS = ("auto", "mindft", "mindio")
RESTART_SCOPES = ("auto", "rank", "all")
SLOW_ACTIONS = ("report", "spare")

# Option → allowed values, as MindSpore 2.10 and the MindCluster guides document them.
_FLAG_VALUES = ("0", "1")
_TFT_OPTIONS: dict[str, tuple[str, ...]] = {
    "ARF": _FLAG_VALUES,  # process-level rescheduling
    "ATO": _FLAG_VALUES,  # adaptive checkpoint-interval advice
    "HCCE": _FLAG_VALUES,  # process-level online recovery of communication errors
    "RSC": _FLAG_VALUES,  # graceful fault tolerance (device plugin -hotReset=1)
    "TRE": ("0", "1", "2"),  # training-result-error recompute; 2 uses snapshots
    "TSP": _FLAG_VALUES,  # step pause
    "TTP": _FLAG_VALUES,  # dying-gasp checkpoint after a fault
    "UCE": _FLAG_VALUES,  # process-level online recovery of on-chip memory errors
}
_TFT_FREE_OPTIONS = ("ATO_PATH", "ATO_THRESHOLD")  # values are not flags
_KNOWN_KEYS = tuple(sorted((*_TFT_OPTIONS, *_TFT_FREE_OPTIONS)))
_KEY_PATTERN = re.compile(r"[A-Z][A-Z0-9_]*")

# The seed: graceful fault tolerance, process-level rescheduling and process-level
# online recovery cannot be enabled at the same time.
_EXCLUSIVE_WITH_RSC = {
    "ARF": "process-level rescheduling",
    "UCE": "process-level online recovery",
    "HCCE": "process-level online recovery",
}
_NEEDS_MINDIO = ("TTP", "UCE", "ARF", "TSP", "HCCE")
_NOT_WITH_ATO = ("TTP", "UCE", "ARF", "TRE", "TSP")


class ConfigError(ValueError):
    """A configuration value is malformed or inconsistent; the message says how to fix it."""


@dataclass(frozen=True)
class TFTOptions:
    """The parsed value of ``MS_ENABLE_TFT``."""

    ttp: bool = False
    uce: bool = False
    arf: bool = False
    hcce: bool = False
    rsc: bool = False
    tsp: bool = False
    tre: int = 0
    ato: bool = False
    ato_path: Optional[str] = None
    ato_threshold: Optional[int] = None

    @property
    def enabled(self) -> bool:
        """True when any option asks for fault tolerance (mindft then takes part)."""
        return any((self.ttp, self.uce, self.arf, self.hcce, self.rsc, self.tsp, self.tre))

    @property
    def needs_mindio(self) -> bool:
        """True when MindSpore itself would require the mindio-ttp wheel for these options."""
        return any(getattr(self, key.lower()) for key in _NEEDS_MINDIO)

    def __str__(self) -> str:
        parts = [f"{f.name.upper()}:{_render(getattr(self, f.name))}"
                 for f in dataclasses.fields(self)
                 if getattr(self, f.name) not in (False, 0, None)]
        return "{" + ",".join(parts) + "}"


def _render(value: object) -> str:
    return "1" if value is True else str(value)


def parse_tft(text: str, variable: str = TFT_VARIABLE) -> TFTOptions:
    """Parse an ``MS_ENABLE_TFT`` value such as ``'{TTP:1,UCE:1}'``.

    Braces are optional, blanks around items and separators are ignored and the
    empty string enables nothing. Keys are case-sensitive and upper case, as in
    MindSpore (which silently ignores ``ttp:1``); a lower-case key is an error
    that suggests the right spelling.
    """
    body = text.strip()
    if body.startswith("{") != body.endswith("}"):
        raise ConfigError(f"{variable}: unbalanced braces in {text!r}; write e.g. '{{RSC:1}}'")
    if body.startswith("{"):
        body = body[1:-1].strip()
    values: dict[str, str] = {}
    if body:
        for position, item in enumerate(body.split(","), start=1):
            key, value = _split_item(item, position, text, variable)
            if key in values and values[key] != value:
                raise ConfigError(f"{variable}: {key} is given twice with different values "
                                  f"({values[key]!r} and {value!r}) in {text!r}; keep one")
            values[key] = value
    return _build_options(values, text, variable)


def _split_item(item: str, position: int, text: str, variable: str) -> tuple[str, str]:
    item = item.strip()
    if not item:
        raise ConfigError(f"{variable}: empty item #{position} in {text!r}; "
                          f"items are KEY:VALUE separated by single commas")
    if ":" not in item:
        if item.upper() in _TFT_OPTIONS:
            raise ConfigError(f"{variable}: item {item!r} in {text!r} has no value; "
                              f"write KEY:VALUE, e.g. '{item.upper()}:1'")
        # Not an option name at all: suggesting '<item>:1' would only trade one error for another.
        raise ConfigError(f"{variable}: {item!r} in {text!r} is not an option; write KEY:VALUE "
                          f"items with keys {', '.join(_KNOWN_KEYS)}, e.g. '{{RSC:1}}'")
    key, value = (part.strip() for part in item.split(":", 1))
    if key not in _KNOWN_KEYS:
        hint = f" (keys are upper case: did you mean {key.upper()!r}?)" if key.upper() in _KNOWN_KEYS else ""
        raise ConfigError(f"{variable}: unknown option {key!r} in {text!r}{hint}; "
                          f"known options: {', '.join(_KNOWN_KEYS)}")
    allowed = _TFT_OPTIONS.get(key)
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{variable}: {key} must be one of {', '.join(allowed)}, "
                          f"got {value!r} in {text!r}")
    if not value:
        raise ConfigError(f"{variable}: {key} has an empty value in {text!r}")
    return key, value


def _build_options(values: Mapping[str, str], text: str, variable: str) -> TFTOptions:
    flags = {key.lower(): values.get(key) == "1" for key in _TFT_OPTIONS if key != "TRE"}
    if flags["arf"] and not flags["ttp"]:
        log.info("%s: ARF:1 implies TTP:1 (as in MindSpore); enabling TTP", variable)
        flags["ttp"] = True
    if flags["rsc"]:
        for key, mode in _EXCLUSIVE_WITH_RSC.items():
            if flags[key.lower()]:
                raise ConfigError(
                    f"{variable}: RSC (graceful fault tolerance) and {key} ({mode}) cannot be "
                    f"enabled at the same time in {text!r}; keep RSC:1 or {key}:1, not both")
    if not flags["ato"] and ("ATO_PATH" in values or "ATO_THRESHOLD" in values):
        raise ConfigError(f"{variable}: ATO_PATH and ATO_THRESHOLD only apply with ATO:1, "
                          f"in {text!r}; add ATO:1 or remove them")
    ato_threshold = None
    if flags["ato"]:
        # MindSpore's own rules for adaptive checkpointing (TrainFaultTolerance).
        others = [key for key in _NOT_WITH_ATO if values.get(key, "0") != "0"]
        if others:
            raise ConfigError(f"{variable}: ATO:1 cannot be combined with {', '.join(others)} "
                              f"in {text!r}; MindSpore runs adaptive checkpointing alone")
        path = values.get("ATO_PATH")
        if path is not None and not path.endswith(".json"):
            raise ConfigError(f"{variable}: ATO_PATH must be a .json file path, got {path!r} in {text!r}")
        threshold = values.get("ATO_THRESHOLD")
        if threshold is not None:
            if not threshold.isdigit() or int(threshold) < 10:
                raise ConfigError(f"{variable}: ATO_THRESHOLD must be an integer >= 10, got "
                                  f"{threshold!r} in {text!r}")
            ato_threshold = int(threshold)
    return TFTOptions(tre=int(values.get("TRE", "0")), ato_path=values.get("ATO_PATH"),
                      ato_threshold=ato_threshold, **flags)


@dataclass(frozen=True)
class Timeouts:
    """Every time limit mindft uses, in seconds (see the README's timeout ladder)."""

    heartbeat_interval: float = 0.5
    heartbeat_misses: int = 6
    register: float = 120.0
    pause: float = 60.0
    repair: float = 180.0
    rollback: float = 180.0
    resume: float = 60.0
    leave: float = 30.0  # for a rank told to leave its device to exit (the device plugin waits 60 s)
    stall: float = 3.0   # restart_all jobs: a rank not paused by then is blocked in a collective
    connect_retries: int = 10
    reset_poll_interval: float = 1.0

    @property
    def dead_after(self) -> float:
        """Silence after which a rank is declared dead or hung."""
        return self.heartbeat_interval * self.heartbeat_misses


@dataclass(frozen=True)
class MindftConfig:
    """Everything one mindft process needs, read by :func:`load_config`."""

    tft: TFTOptions = field(default_factory=TFTOptions)
    rank: int = 0
    world_size: int = 1
    controller_ip: str = "127.0.0.1"
    controller_port: int = DEFAULT_CONTROLLER_PORT
    reset_file: Path = DEFAULT_RESET_FILE
    key_file: Optional[Path] = None
    insecure: bool = False
    dump_dir: Path = Path("mindft_dump")
    state_dir: Optional[Path] = None  # the node agent's shared memory for this rank's snapshots
    restart_count: int = 0
    launcher_pid: int = 0  # mindft-launch's pid when it started this rank; 0: started some other way
    backend: str = "auto"
    snapshot_every: Optional[int] = None  # MINDFT_SNAPSHOT_EVERY; None: the job chooses within the budget
    overhead_budget: float = 0.01
    max_replay_steps: int = 100
    replica_buddy: Optional[int] = None  # None: the next rank; -1: no replica (the node agent holds the state)
    agent_replication: bool = True  # mindft-launch on several nodes: the node agents stream the replicas
    standbys: int = 0  # nodes 1..standbys stand by for the controller (mindft.flow.standby)
    replica_endpoint: str = ""  # the node agent's replica keeper, announced by the rank when it registers
    relay: str = ""  # the node agent's relay of its ranks' control traffic (mindft.agent.relay); "": the controller
    restart_scope: str = "auto"  # "all": a lost process restarts every worker; auto: when a rank says so
    warm_start: bool = True  # mindft-launch forks the workers from a process that imported MindSpore
    preload: str = "mindspore"  # what that process imports, comma-separated
    slow_threshold: float = 0.3  # a rank whose own work per step is this much over its peers' median is slow...
    slow_windows: int = 3  # ...in this many windows in a row (mindft.flow.slow)...
    slow_window: float = 30.0  # ...of this many seconds
    slow_action: str = "report"  # "spare": a node flagged slow is given to a warm spare (mindft.flow.spares)
    # MINDFT_ELASTIC (mindft-launch --nnodes MIN:MAX): the job may go on with no fewer than
    # elastic_min nodes (0: not elastic) and take nodes back up to elastic_max (mindft.flow.elastic).
    elastic_min: int = 0
    elastic_max: int = 0
    shrink_after: float = 30.0  # seconds a lost node is waited for (its launcher, a spare) before the job shrinks
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def controller_address(self) -> str:
        """The ZeroMQ endpoint of the controller."""
        return f"tcp://{self.controller_ip}:{self.controller_port}"

    @property
    def control_address(self) -> str:
        """Where a rank's control traffic goes: its node agent's relay, or the controller itself."""
        return self.relay or self.controller_address


@dataclass(frozen=True)
class EnvVar:
    """One environment variable mindft reads: the README's configuration table is built from these."""

    name: str
    meaning: str
    default: str
    valid: str


@dataclass(frozen=True)
class _Timeout:
    """A numeric setting of :class:`Timeouts` and the variable that overrides it."""

    variable: str
    attribute: str
    kind: type
    low: float
    high: float
    meaning: str


_TIMEOUT_VARS: tuple[_Timeout, ...] = (
    _Timeout("MINDFT_HEARTBEAT_INTERVAL", "heartbeat_interval", float, 0.01, 60,
             "seconds a rank may send, or hear, nothing else before it heartbeats"),
    _Timeout("MINDFT_HEARTBEAT_MISSES", "heartbeat_misses", int, 1, 1000,
             "missed heartbeats before a rank is declared dead or hung"),
    _Timeout("MINDFT_REGISTER_TIMEOUT", "register", float, 1, 86400,
             "seconds for every rank to register at start"),
    _Timeout("MINDFT_PAUSE_TIMEOUT", "pause", float, 1, 86400,
             "seconds for every live rank to pause at a step boundary"),
    _Timeout("MINDFT_REPAIR_TIMEOUT", "repair", float, 1, 86400,
             "seconds for a device to recover or a rank to come back "
             "(cf. TTP_NORMAL_ACTION_TIME_LIMIT)"),
    _Timeout("MINDFT_ROLLBACK_TIMEOUT", "rollback", float, 1, 86400,
             "seconds for every rank to restore the repair step"),
    _Timeout("MINDFT_RESUME_TIMEOUT", "resume", float, 1, 86400,
             "seconds for every rank to acknowledge resume"),
    _Timeout("MINDFT_LEAVE_TIMEOUT", "leave", float, 0.1, 3600,
             "seconds a rank told to leave its device for a hot reset gets to exit before it is killed "
             "(the device plugin gives up after 60 s)"),
    _Timeout("MINDFT_STALL_TIMEOUT", "stall", float, 0.1, 3600,
             "seconds a rank of a job whose collectives cannot be repaired in place (MINDFT_RESTART_SCOPE=all) "
             "gets to pause before it counts as blocked in a collective and every worker restarts; well below "
             "the collective's own timeout (MCCL/HCCL: 30 s)"),
    _Timeout("MINDFT_CONNECT_RETRIES", "connect_retries", int, 1, 300,
             "controller connection attempts (cf. TTP_RETRY_TIMES)"),
    _Timeout("MINDFT_RESET_POLL_INTERVAL", "reset_poll_interval", float, 0.01, 60,
             "seconds between reads of the device plugin reset file"),
)

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(TFT_VARIABLE, "fault-tolerance options, e.g. '{RSC:1}'", "'' (off)",
           "KEY:VALUE items, keys " + ", ".join(_KNOWN_KEYS)),
    EnvVar("MS_TFT_IP", "controller address", "127.0.0.1", "an IPv4/IPv6 address"),
    EnvVar("MS_TFT_PORT", "controller port", str(DEFAULT_CONTROLLER_PORT), "1024..65535"),
    EnvVar("MS_WORKER_NUM", "world size (msrun); RANK_SIZE is read if unset", "1", "1..1048576"),
    EnvVar("MS_NODE_ID", "this process's rank (msrun); RANK_ID is read if unset", "0",
           "0..world size - 1"),
    EnvVar("MINDFT_RESET_FILE", "device plugin reset file", str(DEFAULT_RESET_FILE), "a path"),
    EnvVar("MINDFT_KEY_FILE", "CurveZMQ key pair (mindft-launch writes it)", "unset",
           "a file readable only by the job's user"),
    EnvVar("MINDFT_INSECURE", "1 turns authentication and encryption off (debugging only)", "0",
           "0, 1"),
    EnvVar("MINDFT_DUMP_DIR", "where dying-gasp checkpoints are written, and a keeper's replica while the next "
           "arrives (on disk, not tmpfs)", "mindft_dump", "a path"),
    EnvVar("MINDFT_STATE_DIR", "where this rank's snapshots live, outliving the process (mindft-launch sets "
           "it to a directory on /dev/shm that it owns); unset: in the process's own memory", "", "a path"),
    EnvVar("MINDFT_BACKEND", "who coordinates recovery: mindft's own controller, or MindIO TFT's "
           "(the mindio_ttp wheel) with mindft's snapshots; auto picks mindio only where the wheel is "
           "installed and the job asks for it (MINDX_TASK_ID set, or MS_ENABLE_TFT options MindSpore "
           "runs on mindio_ttp on an Ascend device)", "auto", ", ".join(BACKENDS)),
    EnvVar("MINDFT_SNAPSHOT_EVERY", "snapshot (and replicate) every N-th step, fixed; the same on every "
           "rank, a fault then replays up to N steps; unset: the controller chooses N within "
           "MINDFT_OVERHEAD_BUDGET", "unset", "1..1000000"),
    EnvVar("MINDFT_OVERHEAD_BUDGET", "the slowdown snapshots may cost when MINDFT_SNAPSHOT_EVERY is unset: "
           "the controller snapshots every N-th step, N = ceil(snapshot time / (budget x step time)) from "
           "the slowest ranks' measurements, the same N on every rank", "0.01", "0.0001..1"),
    EnvVar("MINDFT_MAX_REPLAY_STEPS", "the largest N the budget may choose: the most steps a recovery "
           "replays", "100", "1..1000000"),
    EnvVar("MINDFT_RESTART_SCOPE", "what a fault that takes a process restarts: that rank alone, or every "
           "worker (a restarted process cannot rejoin the others' collectives, as with MindSpore's MCCL); "
           "auto: every worker once a rank registers with MindSpore's communicator initialised",
           "auto", ", ".join(RESTART_SCOPES)),
    EnvVar("MINDFT_REPLICA_BUDDY", "the rank whose process keeps this rank's replica (mindft-launch: the "
           "same local rank on the next node, -1 on one node, where the node agent's memory holds the state)",
           "the next rank", "-1..world size - 1"),
    EnvVar("MINDFT_STANDBYS", "nodes after node 0 that stand by for the controller and take over when it is lost "
           "(mindft-launch --standbys)", "0", "0..2"),
    EnvVar("MINDFT_SLOW_THRESHOLD", "a rank whose own work per step (up to its collectives) exceeds its peers' "
           "median by this share is slow in a window (0.3: 30%)", "0.3", "0.05..10"),
    EnvVar("MINDFT_SLOW_WINDOWS", "slow windows in a row that flag a rank (and its node) slow, and healthy ones that "
           "clear it", "3", "1..100"),
    EnvVar("MINDFT_SLOW_WINDOW", "seconds of training in one window of the slow-rank detection", "30", "1..3600"),
    EnvVar("MINDFT_SLOW_ACTION", "what a rank flagged slow does to its node: report (the metrics, the status, the "
           "event log say so), or spare (also: its node is given to a live warm spare, as a lost node is; never node "
           "0, whose agent runs the controller)", "report", ", ".join(SLOW_ACTIONS)),
    EnvVar("MINDFT_ELASTIC", "a data-parallel job that goes on with fewer nodes when one is lost for good, down to "
           "MIN, and takes nodes back up to MAX (mindft-launch --nnodes MIN:MAX)", "'' (not elastic)",
           "MIN:MAX, 1 <= MIN <= MAX"),
    EnvVar("MINDFT_SHRINK_AFTER", "seconds an elastic job waits for a lost node (its launcher again, or a spare) "
           "before it goes on without it (mindft-launch --shrink-after)", "30", "0..86400"),
    EnvVar("MINDFT_AGENT_REPLICATION", "mindft-launch on several nodes: 1, the node agents stream each rank's "
           "newest snapshot to the next node's agent in the background (the ranks push nothing); 0, each rank "
           "streams its newest snapshot to its buddy rank in the background, as ranks started without "
           "mindft-launch do (a step is reported once its replica arrived)", "1", "0, 1"),
    EnvVar("MINDFT_WARM_START", "mindft-launch: 1, each node agent forks its workers and MindSpore's scheduler "
           "from a warm process that imported MINDFT_PRELOAD once (a restart skips the interpreter's start and "
           "the imports); 0, every process starts cold, as under msrun", "1", "0, 1"),
    EnvVar("MINDFT_PRELOAD", "the modules the warm process imports, comma-separated (add the ones your "
           "script imports, e.g. mindspore,mindformers)", "mindspore", "module names"),
    EnvVar("MINDFT_REPLICA_ENDPOINT", "the node agent's replica keeper, which a rank announces when it registers "
           "(mindft-launch sets it with agent replication)", "", "tcp://HOST:PORT"),
    EnvVar("MINDFT_RELAY", "the node agent's relay, through which a rank talks to the controller "
           "(mindft-launch sets it)", "", "ipc://PATH"),
    EnvVar("MINDFT_LAUNCHER_PID", "mindft-launch's pid (it sets it); a rank started without it gives up "
           "after one silent period when no controller answers", "0", "a pid"),
    EnvVar("MINDFT_RESTART_COUNT", "times this rank was restarted (mindft-launch sets it)", "0",
           "0..1000"),
    *(EnvVar(t.variable, t.meaning, str(getattr(Timeouts(), t.attribute)), f"{t.low}..{t.high}")
      for t in _TIMEOUT_VARS),
)

_Number = TypeVar("_Number", int, float)


def _number(environ: Mapping[str, str], name: str, kind: Callable[[str], _Number], default: _Number,
            low: float, high: float) -> _Number:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected {'an integer' if kind is int else 'a number'} "
                          f"in {low}..{high}, got {raw!r}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}: {raw!r} is out of range; valid: {low}..{high}")
    return value


def _one_of(environ: Mapping[str, str], preferred: str, alias: str) -> str:
    """The variable to read among two synonyms (msrun sets both); they must agree."""
    first, second = environ.get(preferred, "").strip(), environ.get(alias, "").strip()
    if first and second and first != second:
        raise ConfigError(f"{preferred}={first!r} and {alias}={second!r} disagree; "
                          f"set them to the same value or unset {alias}")
    return alias if second and not first else preferred


# The variable each setting of MindftConfig comes from (``mindft config check`` names rows by them);
# the timeouts' are _TIMEOUT_VARS'.
FIELD_VARIABLES: dict[str, str] = {
    "rank": "MS_NODE_ID", "world_size": "MS_WORKER_NUM", "controller_ip": "MS_TFT_IP", "controller_port": "MS_TFT_PORT",
    "reset_file": "MINDFT_RESET_FILE", "key_file": "MINDFT_KEY_FILE", "insecure": "MINDFT_INSECURE",
    "dump_dir": "MINDFT_DUMP_DIR", "state_dir": "MINDFT_STATE_DIR", "restart_count": "MINDFT_RESTART_COUNT",
    "launcher_pid": "MINDFT_LAUNCHER_PID", "backend": "MINDFT_BACKEND", "snapshot_every": "MINDFT_SNAPSHOT_EVERY",
    "overhead_budget": "MINDFT_OVERHEAD_BUDGET", "max_replay_steps": "MINDFT_MAX_REPLAY_STEPS",
    "replica_buddy": "MINDFT_REPLICA_BUDDY", "agent_replication": "MINDFT_AGENT_REPLICATION",
    "standbys": "MINDFT_STANDBYS", "replica_endpoint": "MINDFT_REPLICA_ENDPOINT", "relay": "MINDFT_RELAY", "restart_scope": "MINDFT_RESTART_SCOPE",
    "warm_start": "MINDFT_WARM_START", "preload": "MINDFT_PRELOAD", "slow_threshold": "MINDFT_SLOW_THRESHOLD",
    "slow_windows": "MINDFT_SLOW_WINDOWS", "slow_window": "MINDFT_SLOW_WINDOW", "slow_action": "MINDFT_SLOW_ACTION",
    "elastic_min": "MINDFT_ELASTIC", "elastic_max": "MINDFT_ELASTIC", "shrink_after": "MINDFT_SHRINK_AFTER",
    **{t.attribute: t.variable for t in _TIMEOUT_VARS},
}


def load_config(environ: Mapping[str, str] = os.environ) -> MindftConfig:
    """Read and validate every variable mindft uses (see :data:`ENV_VARS`)."""
    tft = parse_tft(environ.get(TFT_VARIABLE, ""))
    size_var = _one_of(environ, "MS_WORKER_NUM", "RANK_SIZE")
    world_size = _number(environ, size_var, int, 1, 1, 1 << 20)
    rank_var = _one_of(environ, "MS_NODE_ID", "RANK_ID")
    rank = _number(environ, rank_var, int, 0, 0, 1 << 20)
    if rank >= world_size:
        raise ConfigError(f"{rank_var}: rank {rank} is not below the world size {world_size} "
                          f"({size_var}); valid ranks: 0..{world_size - 1}")
    ip = environ.get("MS_TFT_IP", "").strip() or "127.0.0.1"
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        raise ConfigError(f"MS_TFT_IP: {ip!r} is not an IP address; use e.g. 127.0.0.1") from None
    insecure = _number(environ, "MINDFT_INSECURE", int, 0, 0, 1) == 1
    key_file = environ.get("MINDFT_KEY_FILE", "").strip() or None
    defaults = Timeouts()
    timeouts = Timeouts(**{
        t.attribute: _number(environ, t.variable, t.kind, getattr(defaults, t.attribute), t.low, t.high)
        for t in _TIMEOUT_VARS})
    backend = environ.get("MINDFT_BACKEND", "").strip() or "auto"
    if backend not in BACKENDS:
        raise ConfigError(f"MINDFT_BACKEND: unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    restart_scope = environ.get("MINDFT_RESTART_SCOPE", "").strip() or "auto"
    if restart_scope not in RESTART_SCOPES:
        raise ConfigError(f"MINDFT_RESTART_SCOPE: unknown scope {restart_scope!r}; valid: {', '.join(RESTART_SCOPES)}")
    elastic = parse_node_range(environ.get("MINDFT_ELASTIC", ""), "MINDFT_ELASTIC") or (0, 0)
    slow_action = environ.get("MINDFT_SLOW_ACTION", "").strip() or "report"
    if slow_action not in SLOW_ACTIONS:
        raise ConfigError(f"MINDFT_SLOW_ACTION: unknown action {slow_action!r}; valid: {', '.join(SLOW_ACTIONS)}")
    return MindftConfig(
        tft=tft,
        backend=backend,
        rank=rank,
        world_size=world_size,
        controller_ip=ip,
        controller_port=_number(environ, "MS_TFT_PORT", int, DEFAULT_CONTROLLER_PORT, 1024, 65535),
        reset_file=Path(environ.get("MINDFT_RESET_FILE", "").strip() or DEFAULT_RESET_FILE),
        key_file=Path(key_file) if key_file else None,
        insecure=insecure,
        dump_dir=Path(environ.get("MINDFT_DUMP_DIR", "").strip() or "mindft_dump"),
        state_dir=Path(environ["MINDFT_STATE_DIR"].strip()) if environ.get("MINDFT_STATE_DIR", "").strip() else None,
        restart_count=_number(environ, "MINDFT_RESTART_COUNT", int, 0, 0, 1000),
        launcher_pid=_number(environ, "MINDFT_LAUNCHER_PID", int, 0, 0, 2**22),
        snapshot_every=(_number(environ, "MINDFT_SNAPSHOT_EVERY", int, 1, 1, 1_000_000)
                        if environ.get("MINDFT_SNAPSHOT_EVERY", "").strip() else None),
        overhead_budget=_number(environ, "MINDFT_OVERHEAD_BUDGET", float, 0.01, 0.0001, 1),
        max_replay_steps=_number(environ, "MINDFT_MAX_REPLAY_STEPS", int, 100, 1, 1_000_000),
        restart_scope=restart_scope,
        replica_buddy=_replica_buddy(environ, world_size),
        agent_replication=_number(environ, "MINDFT_AGENT_REPLICATION", int, 1, 0, 1) == 1,
        standbys=_number(environ, "MINDFT_STANDBYS", int, 0, 0, 2),
        replica_endpoint=_replica_endpoint(environ),
        relay=_relay(environ),
        warm_start=_number(environ, "MINDFT_WARM_START", int, 1, 0, 1) == 1,
        preload=_preload(environ),
        slow_threshold=_number(environ, "MINDFT_SLOW_THRESHOLD", float, 0.3, 0.05, 10),
        slow_windows=_number(environ, "MINDFT_SLOW_WINDOWS", int, 3, 1, 100),
        slow_window=_number(environ, "MINDFT_SLOW_WINDOW", float, 30.0, 1, 3600),
        slow_action=slow_action,
        elastic_min=elastic[0],
        elastic_max=elastic[1],
        shrink_after=_number(environ, "MINDFT_SHRINK_AFTER", float, 30.0, 0, 86400),
        timeouts=timeouts,
    )


def parse_node_range(text: str, name: str) -> Optional[tuple[int, int]]:
    """``MIN:MAX`` nodes (torchrun's and DLRover's ``--nnodes`` syntax) as (MIN, MAX); None for ""."""
    text = text.strip()
    if not text:
        return None
    low, sep, high = text.partition(":")
    try:
        nodes = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1] <= 100000:
        raise ConfigError(f"{name}: {text!r} is not MIN:MAX nodes with 1 <= MIN <= MAX <= 100000; e.g. 2:4")
    return nodes


def _preload(environ: Mapping[str, str]) -> str:
    names = [name.strip() for name in environ.get("MINDFT_PRELOAD", "").split(",") if name.strip()]
    bad = [name for name in names if not all(part.isidentifier() for part in name.split("."))]
    if bad:
        raise ConfigError(f"MINDFT_PRELOAD: {', '.join(map(repr, bad))} is not a module name; valid: "
                          f"comma-separated module names such as mindspore,mindformers")
    return ",".join(names) or "mindspore"


def _replica_endpoint(environ: Mapping[str, str]) -> str:
    endpoint = environ.get("MINDFT_REPLICA_ENDPOINT", "").strip()
    if endpoint and not (endpoint.startswith("tcp://") and endpoint.rpartition(":")[2].isdigit()):
        raise ConfigError(f"MINDFT_REPLICA_ENDPOINT: {endpoint!r} is not tcp://HOST:PORT "
                          f"(mindft-launch sets it; unset it otherwise)")
    return endpoint


def _relay(environ: Mapping[str, str]) -> str:
    endpoint = environ.get("MINDFT_RELAY", "").strip()
    if endpoint and not (endpoint.startswith("ipc://") and len(endpoint) > len("ipc://")):
        raise ConfigError(f"MINDFT_RELAY: {endpoint!r} is not ipc://PATH (mindft-launch sets it; unset it otherwise)")
    return endpoint


def _replica_buddy(environ: Mapping[str, str], world_size: int) -> Optional[int]:
    if not environ.get("MINDFT_REPLICA_BUDDY", "").strip():
        return None
    return _number(environ, "MINDFT_REPLICA_BUDDY", int, -1, -1, world_size - 1)
