"""api: run history over REST (/v1) and the run dashboard, fed from the GRADED and EVENTS streams."""
