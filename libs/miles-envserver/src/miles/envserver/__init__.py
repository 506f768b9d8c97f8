"""The environment server: one hub environment in its own interpreter, behind the protocol of `protocol.py`."""
