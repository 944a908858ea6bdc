from crucible.runtime import run_service
from services.sandbox.app import setup
from services.sandbox.settings import Settings

run_service("sandbox", Settings, setup)
