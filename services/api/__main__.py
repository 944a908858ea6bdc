from crucible.runtime import run_service
from services.api.app import setup
from services.api.settings import Settings

run_service("api", Settings, setup)
