"""Crucible: asynchronous reinforcement learning for coding agents."""

__version__ = "0.1.0"
