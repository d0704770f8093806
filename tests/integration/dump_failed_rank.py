"""launch_rank.py, except that the rank named in GIVE_UP_EXIT_CODE_RANK gives up with
ExitCode.DUMP_FAILED (4): it had to stop and could not write its dying-gasp checkpoint."""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch_rank  # noqa: E402

from mindft.exitcodes import ExitCode  # noqa: E402

if os.environ.get("RANK_ID") == os.environ.get("GIVE_UP_EXIT_CODE_RANK"):
    launch_rank.GIVE_UP_CODE = int(ExitCode.DUMP_FAILED)
launch_rank.Rank().run()
