"""A module the warm-pool tests preload: it leaves a trace that a kernel can look for.

``LOADED_IN`` is the pid that imported it; a warm kernel finds it in ``sys.modules`` (imported
ahead) but never among the user's variables.
"""

import os

LOADED_IN = os.getpid()
