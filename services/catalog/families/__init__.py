"""Task families: each is a small library domain whose units can carry one injected bug."""

from services.catalog.families.base import Family, Mutation, Probe, Unit, call
from services.catalog.families.calendar import CALENDAR
from services.catalog.families.intervals import INTERVALS
from services.catalog.families.parsers import PARSERS
from services.catalog.families.stats import STATS
from services.catalog.families.structures import STRUCTURES
from services.catalog.families.text import TEXT

FAMILIES: tuple[Family, ...] = (STATS, TEXT, INTERVALS, CALENDAR, PARSERS, STRUCTURES)

__all__ = ["FAMILIES", "Family", "Mutation", "Probe", "Unit", "call"]
