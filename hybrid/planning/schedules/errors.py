"""The schedules' one error type, in a module of its own so that ``actions`` and ``stage_map``
can both raise it without importing each other."""

from hybrid.errors import UserError


class ScheduleError(UserError):
    """A schedule that cannot be built or does not hold; the first line says what to change."""
