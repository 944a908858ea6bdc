"""grader: SWE-bench-style rewards (FAIL_TO_PASS / PASS_TO_PASS run in a clean sandbox), anti-cheat checks,
and quality measures of evaluated changes."""
