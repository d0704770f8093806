"""The command lines, for people.

- ``main``: ``mindft``, the group, with ``config check`` and ``keygen``
- ``status``, ``events``, ``inject`` (with ``simulate-device-plugin``): its other subcommands
- ``_common``: what they share: exit codes, CommandError, finding and reaching the controller
- ``launch``: ``mindft-launch``: msrun's flags → the node agent
"""
