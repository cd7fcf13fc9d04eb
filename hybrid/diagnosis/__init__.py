"""Hang, stall and straggler diagnosis, and the faults the tests inject to prove it."""
