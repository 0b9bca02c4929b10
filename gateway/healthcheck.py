"""A container health probe: `python -m gateway.healthcheck HOST:PORT`.

Asks the gateway's `/healthz` (both upstreams SERVING) and exits 0 only on
200, so that Docker can tell a gateway that can serve from one that cannot.
Prints one line saying what it saw.

Exit codes: 0 serving, 1 anything else, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from services.common.healthcheck import EXIT_SERVING, EXIT_UNHEALTHY, address_argument, seconds_argument


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the probe; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.healthcheck",
        description="Exit 0 if the gateway's /healthz answers 200 (both upstreams serving).",
    )
    parser.add_argument("address", type=address_argument, help="HOST:PORT of the gateway")
    parser.add_argument(
        "--timeout", type=seconds_argument, default=3.0, help="timeout in seconds (default: 3)"
    )
    options = parser.parse_args(argv)
    url = f"http://{options.address}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=options.timeout) as response:
            body = response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        print(f"gateway at {options.address}: HTTP {error.code} {error.read().decode(errors='replace')}")
        return EXIT_UNHEALTHY
    except OSError as error:
        print(f"gateway at {options.address}: {error}", file=sys.stderr)
        return EXIT_UNHEALTHY
    print(f"gateway at {options.address}: {body}")
    return EXIT_SERVING


if __name__ == "__main__":
    sys.exit(main())
