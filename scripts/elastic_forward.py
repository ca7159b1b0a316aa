"""Write the BENCHMARKS.md section "## Elastic pools: forward-simulated ranking (simulator)" and its plot
(docs/bench/elastic-forward-ranker.png).

The six rows of the mix-shift day (both cost profiles; mix by load and by requests on 8 H100s, mix by load on
8 H200s), each elastic day and P/D phase run with the balancer's forward ranker off and on, side by side. It leaves
the section "## Elastic pools (simulator)" and its plots alone. About 10 minutes on one core; progress on stderr.
Usage: python scripts/elastic_forward.py [extra `octoserve elastic-day` flags]
"""

import sys

from octoserve.services.cli import main

if __name__ == "__main__":
    extra = sys.argv[1:]
    sys.exit(main(["elastic-day", "--cost-profile", "both", "--also-requests", "--also-gpu", "h200-141gb",
                   "--plots", "", "--benchmarks", "", "--ranker", "none", "--role-changes", "drain", "--compare-ranker", "forward",
                   "--ranker-benchmarks", "BENCHMARKS.md", "--ranker-plots", "docs/bench", "--command-line",
                   " ".join(["python scripts/elastic_forward.py", *extra]).strip(), *extra]))
