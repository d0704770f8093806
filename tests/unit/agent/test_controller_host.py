"""The controller's port taken between mindft-launch's check and the controller's bind (the check
itself, and the launcher's one line: tests/integration/cli/test_launch_errors.py)."""
from __future__ import annotations

import pytest


def test_a_controller_port_taken_after_the_check_is_a_configuration_error(listener: tuple[int, int]) -> None:
    """The port can be taken between mindft-launch's check and the controller's bind: still one
    ConfigError (mindft-launch: exit 2, its run directory cleaned), not ZMQError's traceback."""
    from mindft.agent.links import ControllerHost
    from mindft.config import ConfigError, MindftConfig

    port, _ = listener
    with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1, the controller's port, is in use; "
                                          f"choose another --master-port"):
        ControllerHost(MindftConfig(world_size=1, controller_port=port, insecure=True))
