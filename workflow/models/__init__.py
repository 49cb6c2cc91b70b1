"""Checkpoints and models: synthetic, trained, local and hub checkpoints; transformers' model; engine sessions."""
