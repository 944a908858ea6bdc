"""Sandbox service: per-episode workspaces isolated with bubblewrap, and the agent's tools."""
