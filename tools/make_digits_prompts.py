"""Write specray/data/digits_captions_heldout.jsonl, the built-in prompt set ``builtin:digits-captions``.

One caption per held-out digits image (the images the text presets never trained on), in the
held-out split's order, with the phrasing the caption bank uses for that split. Rerun after a change
to the caption vocabulary; the file is committed so that its digest (which joins a job's
fingerprint) never moves with a library version.
"""

from __future__ import annotations

import json
from pathlib import Path

from specray.models.digits import load_digits_split, to_uint8_pixels
from specray.models.digits_captions import image_captions
from specray.models.text_training import _SPLIT_OFFSET

OUT = Path(__file__).resolve().parents[1] / "specray" / "data" / "digits_captions_heldout.jsonl"


def main() -> None:
    images, labels = load_digits_split("heldout")
    pixels = to_uint8_pixels(images).numpy()
    lines = []
    for i in range(len(labels)):
        text = image_captions(_SPLIT_OFFSET["heldout"] + i, pixels[i], int(labels[i]), 1)[0]
        lines.append(json.dumps({"id": f"heldout-{i:04d}", "prompt": text, "digit": int(labels[i])}))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {OUT}")


if __name__ == "__main__":
    main()
