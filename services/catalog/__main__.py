from crucible.runtime import run_service
from services.catalog.app import setup
from services.catalog.settings import Settings

run_service("catalog", Settings, setup)
