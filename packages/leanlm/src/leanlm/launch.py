"""`python -m leanlm.launch`: torchrun's front, started by `leanlm.run.launch.relaunch`.

Instead of the `torchrun` script: it runs torchrun without its error report (the failing worker
prints its own error once) and ends torchrun if the launcher dies.
"""

import sys

from leanlm.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
