"""What the benchmarks share: free ports on 127.0.0.1, the command line of one that writes its results.

bench/ is not a package: each script runs with bench/ as its directory, so ``from _common import ...``.
"""
from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A port free on 127.0.0.1 right now, for a server the benchmark starts on a port of its choosing."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P and P + 1 free (MindSpore's scheduler and mindft's controller), picked as
    mindft-launch picks them: below the kernel's ephemeral range."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the tree under test, when it is not installed
    from mindft.agent.plan import free_port_pair as pick

    return pick("127.0.0.1")


def results_parser(doc: str, name: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first line, ``--quick`` (``quick``: what it runs)
    and ``--output`` (default bench/results/NAME.json)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / f"{name}.json")
    return parser
