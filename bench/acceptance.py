"""Mean acceptance length of the discrete drafters on the digits target at equal draft depth.

The separate draft GPT (``digits-gpt-draft``) and the EAGLE head (``digits-gpt-eagle``) on chains of
``--gamma`` tokens, and the head on static trees (``small``: depth 4; ``eagle25``: depth 5). Lossless
``sd`` and LANTERN++ / COOL-SD (delta 2.0) on the head's tree. Acceptance length = image tokens per
target call (bonus and prefill included), over ``--per-class`` samples of each of the 10 classes at
seed ``--seed``; deterministic (the counter-based streams), so no repetitions are needed. No timing:
speed is ``bench/discrete.py``'s job.

    python bench/acceptance.py                 # 100 samples (10 per class), ~2 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specray.families import family  # noqa: E402
from specray.methods.discrete.loop import generate_tokens  # noqa: E402
from specray.models.discrete_ar import load_pair  # noqa: E402

TARGET, DRAFT, HEAD = "digits-gpt-target", "digits-gpt-draft", "digits-gpt-eagle"


def rows(gamma: int) -> list[tuple[str, str, str, dict]]:
    return [
        ("draft GPT, chain", DRAFT, "sd", {"gamma": gamma}),
        ("EAGLE head, chain", HEAD, "sd", {"gamma": gamma}),
        ("EAGLE head, tree small (depth 4)", HEAD, "sd", {"tree": "small"}),
        ("EAGLE head, tree eagle25 (depth 5)", HEAD, "sd", {"tree": "eagle25"}),
        ("EAGLE head, tree small, LANTERN++", HEAD, "lantern", {"tree": "small"}),
        ("EAGLE head, tree small, COOL-SD d=2", HEAD, "cool_sd", {"tree": "small", "delta": 2.0}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--per-class", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = 10 * args.per_class
    labels, sample_ids = torch.arange(n) % 10, torch.arange(n)
    pairs = {name: load_pair(TARGET, name, "cpu") for name in (DRAFT, HEAD)}
    print(f"{n} samples ({args.per_class} per class), seed {args.seed}, batch {args.batch_size}")
    print(f"{'drafter / shape / rule':38s} {'len':>6s} {'alpha':>6s}")
    for label, draft, method, raw in rows(args.gamma):
        params = family("discrete_ar").parse_params(method, raw)
        tokens = calls = drafted = accepted = 0
        for start in range(0, n, args.batch_size):
            part = slice(start, start + args.batch_size)
            _, stats = generate_tokens(method, params, pairs[draft], labels[part], sample_ids[part], args.seed)
            tokens += sum(s.num_tokens for s in stats)
            calls += sum(s.target_calls for s in stats)
            drafted += sum(s.num_draft_tokens for s in stats)
            accepted += sum(s.num_accepted_draft_tokens for s in stats)
        print(f"{label:38s} {tokens / calls:6.3f} {accepted / max(drafted, 1):6.3f}", flush=True)


if __name__ == "__main__":
    main()
