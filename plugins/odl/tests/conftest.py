from dlrover_core.testing import *  # noqa: F401,F403
