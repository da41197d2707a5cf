"""specray's CPU kernels against torch's operations, side by side in one run.

On a CPU the discrete GPTs' calls of one query (decode steps) and of 4 to 9 (verify calls) run
:mod:`specray.models.decode_attention` where it matched torch's kernel, and a verify call's K/V writes
run the C++ row copies of :class:`specray.models.discrete_ar.BlockWrite`, over caches that grow with their
calls (:meth:`specray.models.discrete_ar.KVCache.reserve`, ``growing``), and their RMSNorms run one C++ call
each (:mod:`specray.models.cpu_norm`, ``norm``), and the speculative loops' draws and round decisions
one call each (:mod:`specray.methods.discrete.cpu_rounds`, ``rounds``), and a call's attention mask is rows of
a kept table (:func:`specray.models.discrete_ar.causal_mask`, ``masks``), and a call's layers run in one C++ call
(:class:`specray.models.discrete_ar.FusedLayers`, ``layers``), with the work around them in that call too (the
embedding, rotary and mask lookups, cache lengths, final norm and output layer, ``step``; only with ``layers``),
and a call's decisions read its positions from one host copy (:class:`specray.models.discrete_ar.HostPositions`,
``host``) and its C++ call makes the default sampler's probabilities (:class:`specray.models.discrete_ar.CfgSoftmax`,
``softmax``; only with ``step``); ``torch`` is what every call did before (``SPECRAY_DECODE_KERNEL=0``, static caches,
masks built each call, the Python layers), ``kernels`` turns on those given by ``--kernels`` (default all ten);
``--both`` names kernels on in both settings, to measure one on top of the others (``--kernels norm --both
attention,writes,growing``).
For each batch size and arm (fid50k's: target_only, sd, cool_sd, gamma 4, CFG 1.5, on digits-gpt-target
with the draft digits-gpt-draft) it prints:

- ``torch`` / ``kernels``: ms per sample, median over repetitions, process CPU time; the two settings
  take turns batch by batch (:func:`bench.pricing.run_in_turns`);
- ``ratio``: median over repetitions of torch time / kernels time (> 1: the kernels are faster);
- ``differ``: samples whose tokens or statistics differ between the two, on any repetition (the kernels
  are meant to change no bit: 0).

    python bench/decode_attention.py [--batches 1,32,128] [--reps 5] [--samples-b1 4]
                                     [--kernels attention,writes,growing,norm,rounds,masks,layers,step,host,softmax]
                                     [--both ...]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.attention_span import arguments, side_by_side  # noqa: E402
from specray.methods.discrete import cpu_rounds  # noqa: E402
from specray.models import cpu_norm, decode_attention, discrete_ar  # noqa: E402

# Each kernel's switch: (module, attribute).
KERNELS = {"attention": (decode_attention, "ENABLED"), "writes": (discrete_ar, "BLOCK_WRITE_KERNEL"),
           "growing": (discrete_ar, "GROWING_CACHES"), "norm": (cpu_norm, "ENABLED"),
           "rounds": (cpu_rounds, "ENABLED"), "masks": (discrete_ar, "MASK_TABLES"),
           "layers": (discrete_ar, "FUSED_LAYERS"), "step": (discrete_ar, "FUSED_STEP"),
           "host": (discrete_ar, "HOST_POSITIONS"), "softmax": (discrete_ar, "FUSED_SOFTMAX")}


def settings(kernels: list[str], both: tuple[str, ...] = ()) -> dict[str, Callable[[], None]]:
    """``torch``: every kernel off but ``both``; ``kernels``: ``both`` and those named on."""
    def apply(on: bool) -> None:
        for name, (module, switch) in KERNELS.items():
            setattr(module, switch, name in both or (on and name in kernels))

    return {"torch": lambda: apply(False), "kernels": lambda: apply(True)}


def _kernels_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"the kernels the second setting turns on, comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--both", default="", help="kernels on in both settings, comma-separated (default none)")


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__, argv, batches="1,32,128", extra=_kernels_option)
    kernels, both = args.kernels.split(","), tuple(filter(None, args.both.split(",")))
    for option, names in (("--kernels", kernels), ("--both", both)):
        unknown = sorted(set(names) - set(KERNELS))
        if unknown:
            sys.exit(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    torch.set_num_threads(1)
    decode_attention.prepare()  # build and check outside the timed runs
    served = [n for n in decode_attention.QUERIES if decode_attention.kernel(n) is not None]
    if "attention" in (*kernels, *both) and not served:
        sys.exit("specray's decode-attention kernel is not in use here (see the log above); leave `attention` out of "
                 "--kernels and --both to compare the others")
    if "attention" in (*kernels, *both) and len(served) < len(decode_attention.QUERIES):
        print(f"# the decode-attention kernel serves calls of {', '.join(map(str, served))} queries here; torch's "
              "kernel the others")
    title = f"torch's operations vs specray's CPU kernels ({', '.join(kernels)})"
    if both:
        title += f", {', '.join(both)} on in both"
    side_by_side(title, settings(kernels, both), args)


if __name__ == "__main__":
    main()
