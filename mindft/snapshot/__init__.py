"""The state: the in-memory snapshot store, its slots and checksums, the one atomic write.

- ``store``: capture, restore, the dying-gasp dump
- ``slots``: snapshot slots, their manifests and checksums
- ``ckpt``: the one atomic-write helper and the MindSpore ``.ckpt`` writer
"""
