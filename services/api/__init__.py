"""api: run history over REST (/v1), fed from the GRADED and EVENTS streams."""
