"""`python -m octoserve.router ...`: run the router process (see octoserve.router.app)."""

import sys

from octoserve.router.app import main

if __name__ == "__main__":
    sys.exit(main())
