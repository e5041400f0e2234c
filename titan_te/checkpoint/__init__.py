"""DCP checkpoints: named Stateful parts, background saves, atomic step folders, lineages, resume."""
from titan_te.checkpoint.errors import describe
from titan_te.checkpoint.folder import Manifest, complete_steps, step_dir
from titan_te.checkpoint.manager import CheckpointManager, SaveRecord
from titan_te.checkpoint.parts import PARTS, training_parts
from titan_te.errors import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "Manifest", "PARTS", "SaveRecord", "complete_steps", "describe",
           "step_dir", "training_parts"]
