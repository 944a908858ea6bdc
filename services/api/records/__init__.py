"""Run history from the bus into the database, idempotently: at-least-once delivery may repeat any
message, and the tables must look as if each arrived once."""

from services.api.records.events import apply_event
from services.api.records.graded import grading_key, record_graded

__all__ = ["apply_event", "grading_key", "record_graded"]
