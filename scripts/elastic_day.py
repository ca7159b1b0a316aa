"""Write the BENCHMARKS.md section "## Elastic pools (simulator)" and its plots (docs/bench/elastic-*.png).

The mix-shift day under both cost profiles: best static vs hourly oracle vs the elastic balancer, mix by load and
by requests, on 8 H100s and (mix by load) on 8 H200s, plus the P/D phase with the 8B disaggregated (fixed vs
balanced P:D ratio). About 4-5 minutes on one core; progress goes to stderr.
Usage: python scripts/elastic_day.py [extra `octoserve elastic-day` flags]
"""

import sys

from octoserve.services.cli import main

if __name__ == "__main__":
    extra = sys.argv[1:]
    sys.exit(main(["elastic-day", "--cost-profile", "both", "--also-requests", "--also-gpu", "h200-141gb",
                   "--plots", "docs/bench",
                   "--benchmarks", "BENCHMARKS.md", "--command-line",
                   " ".join(["python scripts/elastic_day.py", *extra]).strip(), *extra]))
