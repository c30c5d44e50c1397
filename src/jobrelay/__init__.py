"""jobrelay: background jobs that never silently disappear and never silently happen twice.

The public surface is deliberately small: settings, the error tree and the job states.
Everything else is reached through the ``jobrelay`` command or the HTTP API.
"""

from jobrelay.domain.states import JobState
from jobrelay.errors import JobrelayError
from jobrelay.settings import Settings

__all__ = ["JobState", "JobrelayError", "Settings"]
__version__ = "0.1.0"
