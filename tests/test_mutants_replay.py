"""The replay guard on one piece, asserted exactly (counters, reasons, log lines), through the
stand-in backend (``replay_stand_in``).

Written against mutants of the replay guard that the stream tests let through
(``bench/mutation.py``, ``bench/results/2026-11-30-mutation.md``)."""
from __future__ import annotations
