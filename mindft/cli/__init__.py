"""The command lines, for people.

- ``main``: ``mindft``: config check, status, events, inject, simulate-device-plugin, keygen
- ``launch``: ``mindft-launch``: msrun's flags → the node agent
"""
