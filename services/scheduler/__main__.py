"""`python -m octoserve.services.scheduler ...`: run the central scheduler process (see octoserve.services.scheduler.service)."""

import sys

from octoserve.services.scheduler.service import main

if __name__ == "__main__":
    sys.exit(main())
