"""The catalog service: generated task sets, verified before they are served, sampled over the bus."""
