"""The catalog service: task sets (generated, imported, synthesized), verified before they are served, sampled
and listed by split over the bus."""
