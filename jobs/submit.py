"""Entrypoint for ``ray job submit``: ``specray run`` on the cluster the submission runs on.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/submit.py jobs/fid50k.yaml --output s3://bucket/specray/fid50k

It takes exactly the arguments of ``specray run`` and runs the same code (``specray.cli``): the
spec is validated before anything touches Ray or the output; a job with a ``dataset:`` section
publishes a dataset partition; any other job writes a run and, unless ``--no-reduce`` or
``eval.fid: false``, its FID / speedup report, reading the output with the spec's storage options.
Ray sets RAY_ADDRESS for the entrypoint, so the driver joins that cluster (it never starts its own).
Progress goes to stderr, which ``ray job logs`` shows.

Exit codes: 0 done, 2 bad input (spec, output, credentials), 1 a shard exhausted its retries.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if (_REPO / "specray" / "__init__.py").is_file() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # the uploaded working dir's specray, when submitted with --working-dir .


def main(argv: list[str] | None = None) -> None:
    from specray.cli import main as specray_main

    specray_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
