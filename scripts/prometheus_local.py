"""Start a Prometheus that scrapes a local Ray's metrics (dpfl's ``ray_dpfl_*`` series).

::

    python scripts/prometheus_local.py [--session-dir DIR] [--port 9090] [--data DIR]
                                       [--scrape-interval 5s] [--prometheus PATH]

Ray writes the addresses of its metrics endpoints to a Prometheus service-discovery
file in its session folder (``/tmp/ray/session_latest/prom_metrics_service_discovery.json``
for the newest local Ray); this script writes a configuration that reads that file and
runs the ``prometheus`` binary on it (Debian's package, or ``--prometheus PATH`` /
``$PROMETHEUS``), listening on 127.0.0.1 only, in the foreground until Ctrl-C. Nothing is
downloaded (Ray's ``ray metrics launch-prometheus`` downloads a Prometheus release).
Then open http://127.0.0.1:9090/graph and query e.g. ``ray_dpfl_epsilon_spent``.

The Ray must outlive a run for its series to be scraped after it: start one with
``ray start --head`` and attach the dpfl commands to it (``--set ray.address=auto``);
a Ray that ``dpfl run`` starts itself ends with the run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import monitoring  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--session-dir",
        default=str(monitoring.DEFAULT_SESSION),
        help="the Ray session folder (default /tmp/ray/session_latest)",
    )
    p.add_argument("--port", type=int, default=9090, help="Prometheus port on 127.0.0.1")
    p.add_argument("--data", help="configuration and database folder (default: a temporary one)")
    p.add_argument("--scrape-interval", default="5s", help="Prometheus scrape interval")
    p.add_argument("--prometheus", help="the prometheus binary (default: $PROMETHEUS, PATH)")
    args = p.parse_args(argv)
    try:
        sd = monitoring.discovery_file(args.session_dir)
    except FileNotFoundError as e:
        print(f"prometheus_local: error: {e}", file=sys.stderr)
        return 2
    if monitoring.find_prometheus(args.prometheus) is None:
        print(
            "prometheus_local: error: no prometheus binary (install Debian's `prometheus` "
            "package, or give --prometheus PATH)",
            file=sys.stderr,
        )
        return 2
    data = Path(args.data or tempfile.mkdtemp(prefix="dpfl-prometheus-"))
    proc = monitoring.start_prometheus(
        sd, data, args.port, binary=args.prometheus, scrape_interval=args.scrape_interval
    )
    print(f"Prometheus on http://127.0.0.1:{args.port} scraping the targets in {sd}")
    print(f"configuration and database: {data}; Ctrl-C stops it")
    print("try: ray_dpfl_epsilon_spent, ray_dpfl_rounds_completed_total, ray_dpfl_test_accuracy")
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        monitoring.stop_process(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
