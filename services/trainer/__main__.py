from crucible.runtime import run_service
from services.trainer.app import setup
from services.trainer.settings import Settings

run_service("trainer", Settings, setup)
