"""`python -m leanlm.launch`: torchrun's front, started by `leanlm.run.launch.relaunch`."""

import sys

from leanlm.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
