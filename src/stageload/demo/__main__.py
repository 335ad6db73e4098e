"""``python -m stageload.demo worker MODE ...``: one run of the demo, in its own process."""

import sys

from . import worker_main

if len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker_main(sys.argv[2:]))
sys.exit("usage: python -m stageload.demo worker MODE ...; for the demo run 'stageload demo'")
