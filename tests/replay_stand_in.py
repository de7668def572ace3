"""The CPU stand-in for the device-graph backend, kept in the package
(``cadence_fx/replay_stand_in.py``) so that bench/ can use it without importing from tests/."""
from cadence_fx.replay_stand_in import Capture, StandInBackend

__all__ = ["StandInBackend", "Capture"]
