"""`python -m kerasdist.run -np N command...`, the same as `kerasdist run`."""

import sys

from kerasdist.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
