"""p50/p99 of MultiLoRA.route() for registries of 10, 1k, 10k and 100k adapters.

    python benchmarks/route_overhead.py            # same as: acelora bench route
"""

import sys

from acelora.bench import bench_main

if __name__ == "__main__":
    raise SystemExit(bench_main(["route", *sys.argv[1:]]))
