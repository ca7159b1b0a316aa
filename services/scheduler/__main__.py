"""`python -m services.scheduler ...`: run the central scheduler process (see services.scheduler.service)."""

import sys

from services.scheduler.service import main

if __name__ == "__main__":
    sys.exit(main())
