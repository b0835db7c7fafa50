from dlrover_core.testing import *
