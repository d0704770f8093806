"""``python -m mindft.controller``: a controller configured from the environment (mindft-launch
normally runs it in node 0's agent)."""
from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from mindft.config import ConfigError, load_config
from mindft.controller.shell import Controller
from mindft.exitcodes import ExitCode


def serve(args: Sequence[str]) -> int:
    """``python -m mindft.controller``: run a controller configured from the environment."""
    args = list(args)
    if args:
        print("usage: python -m mindft.controller\n\nRuns a mindft controller configured from the "
              "environment (MS_TFT_IP, MS_TFT_PORT, MS_WORKER_NUM, MINDFT_KEY_FILE, ...; see "
              "'mindft config check'). Normally mindft-launch runs it for you.",
              file=sys.stderr if args not in (["-h"], ["--help"]) else sys.stdout)
        return ExitCode.OK if args in (["-h"], ["--help"]) else ExitCode.USAGE
    logging.basicConfig(level=os.environ.get("MINDFT_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        controller = Controller(load_config())
    except ConfigError as error:
        print(f"mindft controller: configuration error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    controller.start()
    try:
        while controller.join(0.5) is None:
            pass
    except KeyboardInterrupt:
        controller.stop()
        print("mindft controller: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    print(f"mindft controller: {controller.result.reason}", flush=True)
    return controller.result.exit_code


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1:]))
