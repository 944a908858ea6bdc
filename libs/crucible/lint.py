"""ruff as Crucible lints code: the grader's lint measure of a change and the agent's `read_lints` tool
run the same checks. Errors and warnings of pycodestyle and pyflakes (E, F, W), with none of the
repository's configuration (`--isolated`: a change could otherwise silence what it introduces); ruff
reads the code and never runs it."""

RUFF_CHECK = ("python", "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "E,F,W")
