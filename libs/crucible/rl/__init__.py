"""RL math as pure functions: advantages, losses, off-policy corrections, staleness rules."""
