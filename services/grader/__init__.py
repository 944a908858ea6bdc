"""grader: rewards from hidden tests run in a clean sandbox, with anti-cheat checks and shaping."""
