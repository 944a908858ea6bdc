"""`python -m crucible.db upgrade|downgrade|current`, for images and jobs that run migrations."""

from crucible.cli.db import cli

cli()
