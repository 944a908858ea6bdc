from crucible.runtime import run_service
from services.grader.app import setup
from services.grader.settings import Settings

run_service("grader", Settings, setup)
