"""The device plugin's side: its reset file, the watcher that reads it, and a simulator.

- ``resetfile``: the reset file's format, exactly as the device plugin writes it
- ``watch``: the watcher: reads the reset file, emits :mod:`mindft.flow.inputs`
- ``simulator``: the device plugin played for tests and drills (``mindft simulate-device-plugin``)
"""
