"""`python -m leanlm ...`."""

import sys

from leanlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
