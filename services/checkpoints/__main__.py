from crucible.runtime import run_service
from services.checkpoints.app import setup
from services.checkpoints.settings import Settings

run_service("checkpoints", Settings, setup)
