"""Checkpoints: the .pt container, the checkpoint format and its validation."""
