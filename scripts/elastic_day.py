"""Write the BENCHMARKS.md section "## Elastic pools (simulator)" and its plots (docs/bench/elastic-*.png).

The mix-shift day under both cost profiles: best static vs hourly oracle vs the elastic balancer, mix by load and
by requests, plus the P/D phase with disaggregated placements (fixed vs balanced P:D ratio). About 5-10 minutes on
one core; progress goes to stderr. Usage: python scripts/elastic_day.py [extra `octoserve elastic-day` flags]
"""

import sys

from octoserve.services.cli import main

if __name__ == "__main__":
    extra = sys.argv[1:]
    sys.exit(main(["elastic-day", "--cost-profile", "both", "--also-requests", "--plots", "docs/bench",
                   "--benchmarks", "BENCHMARKS.md", "--command-line",
                   " ".join(["python scripts/elastic_day.py", *extra]).strip(), *extra]))
