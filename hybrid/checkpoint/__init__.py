"""Checkpoints that any layout loads: DCP files keyed by global parameter names.

``store`` (pure: naming, manifest, resolution, checks made before launch), ``dcp_io`` (the DCP
state dict and the safe reader), ``checkpointer`` (what the training loop calls), with
``publish`` (a written checkpoint made visible) and ``restore`` (a checkpoint loaded into a rank).
"""

from hybrid.checkpoint.store import CheckpointError, resolve_resume

__all__ = ["CheckpointError", "resolve_resume"]
