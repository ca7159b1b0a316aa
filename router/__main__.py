"""`python -m router ...`: run the router process (see router.app)."""

import sys

from router.app import main

if __name__ == "__main__":
    sys.exit(main())
