"""The CPU decode-attention kernel against torch's attention kernel, side by side in one run.

On a CPU the discrete GPTs' calls of one query (decode steps) and of 4 to 9 (verify calls) run
:mod:`specray.models.decode_attention` where it matched torch's kernel; ``torch`` is what every call did
before (``SPECRAY_DECODE_KERNEL=0``). For each batch size and arm (fid50k's: target_only, sd, cool_sd,
gamma 4, CFG 1.5, on digits-gpt-target with the draft digits-gpt-draft) it prints:

- ``torch`` / ``kernel``: ms per sample, median over repetitions, process CPU time; the two settings
  take turns batch by batch (:func:`bench.pricing.run_in_turns`);
- ``ratio``: median over repetitions of torch time / kernel time (> 1: the kernel is faster);
- ``differ``: samples whose tokens or statistics differ between the two, on any repetition (the kernel
  is meant to change no bit: 0).

    python bench/decode_attention.py [--batches 1,32,128] [--reps 5] [--samples-b1 4] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention_span import arguments, side_by_side  # noqa: E402
from specray.models import decode_attention  # noqa: E402

SETTINGS = {"torch": lambda: setattr(decode_attention, "ENABLED", False),
            "kernel": lambda: setattr(decode_attention, "ENABLED", True)}


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__, argv, batches="1,32,128")
    torch.set_num_threads(1)
    decode_attention.prepare()  # build and check outside the timed runs
    if decode_attention.kernel(1) is None:
        sys.exit("the decode-attention kernel is not in use here (see the log above)")
    side_by_side("torch's attention kernel vs the decode-attention kernel", SETTINGS, args)


if __name__ == "__main__":
    main()
