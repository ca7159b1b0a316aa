"""`python -m octoserve.http_front ...`: run the OpenAI-compatible HTTP front (see octoserve.http_front.app)."""

import sys

from octoserve.http_front.app import main

if __name__ == "__main__":
    sys.exit(main())
