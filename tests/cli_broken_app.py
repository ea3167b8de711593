"""An application module whose import fails (a setting missing from the environment), for the
CLI's ``--app`` error (one line, not a traceback)."""

import os

DATABASE_URL = os.environ["DELAYEDQ_TEST_SETTING_THAT_IS_NEVER_SET"]
