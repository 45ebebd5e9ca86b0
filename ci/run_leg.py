"""Run one CI leg of ci/matrix.json, or every leg this machine can run (``all``).

python ci/run_leg.py cpu            # one leg
python ci/run_leg.py all            # every cpu_only leg, one after another
python ci/run_leg.py --list         # the legs, as JSON (the GitHub workflow expands this)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX = json.loads((ROOT / "ci" / "matrix.json").read_text())["legs"]


def _pytest(args: list[str], env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", *args]
    print(f"\n$ {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, cwd=ROOT, env={**os.environ, **env})


def run_leg(leg: dict) -> int:
    """Run a leg's tests, then the conformance suite for each of its platforms."""
    started = time.monotonic()
    paths = [a for a in leg["pytest"] if not a.startswith("-")]
    missing = [p for p in paths if not (ROOT / p).exists()]
    if missing:
        print(f"leg {leg['name']}: missing test paths {missing}", file=sys.stderr)
        return 1
    rc = _pytest(leg["pytest"], leg["env"])
    for platform, extra_env in leg["conformance"]:
        if rc != 0:
            break
        rc = _pytest(
            ["--pyargs", "octavo.testing.conformance", "--octavo-platform", platform],
            {**leg["env"], **extra_env},
        )
    outcome = "passed" if rc == 0 else "FAILED"
    print(f"leg {leg['name']}: {outcome} in {time.monotonic() - started:.0f}s")
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("leg", nargs="?", default="all")
    parser.add_argument("--list", action="store_true", help="print the matrix as JSON and exit")
    args = parser.parse_args()
    if args.list:
        print(json.dumps([{"name": leg["name"], "runs_on": leg["runs_on"]} for leg in MATRIX]))
        return 0
    legs = (
        [leg for leg in MATRIX if leg["cpu_only"]]
        if args.leg == "all"
        else [leg for leg in MATRIX if leg["name"] == args.leg]
    )
    if not legs:
        print(
            f"unknown leg {args.leg!r}; legs: {', '.join(leg['name'] for leg in MATRIX)}",
            file=sys.stderr,
        )
        return 2
    failed = [leg["name"] for leg in legs if run_leg(leg) != 0]
    if failed:
        print(f"failed legs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
