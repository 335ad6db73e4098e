"""``python -m stageload.meter`` is the sampler process that ``MemoryMeter`` starts.

It lives here rather than as ``python -m stageload.meter.sampler``: the package imports
``sampler``, and running an already imported module with ``-m`` makes runpy warn.
"""

import sys

from .sampler import main

sys.exit(main())
