"""Write the BENCHMARKS.md section "## Elastic pools: in-place role changes (simulator)".

The six rows of the mix-shift day (both cost profiles; mix by load and by requests on 8 H100s, mix by load on
8 H200s), each elastic day run four times on the same trace: the capacity estimate alone or the forward ranker,
role changes drained or (decode <-> colocated) in place. It leaves the other sections and plots alone. About
15 minutes on one core; progress on stderr.
Usage: python scripts/elastic_in_place.py [extra `octoserve elastic-day` flags]
"""

import sys

from octoserve.services.cli import main

if __name__ == "__main__":
    extra = sys.argv[1:]
    sys.exit(main(["elastic-day", "--cost-profile", "both", "--also-requests", "--also-gpu", "h200-141gb",
                   "--plots", "", "--benchmarks", "", "--ranker", "none", "--role-changes", "drain",
                   "--compare-ranker", "forward", "--ranker-plots", "",
                   "--compare-in-place", "--in-place-benchmarks", "BENCHMARKS.md", "--command-line",
                   " ".join(["python scripts/elastic_in_place.py", *extra]).strip(), *extra]))
