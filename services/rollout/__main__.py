from crucible.runtime import run_service
from services.rollout.app import setup
from services.rollout.settings import Settings

run_service("rollout", Settings, setup)
