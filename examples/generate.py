"""Load an exported byte-level language model with ``from_pretrained`` and continue a prompt, greedily.

    python -m examples.generate FOLDER "PROMPT" [--bytes N]

FOLDER is a ``save_pretrained`` folder that ``lightning-multids export CKPT OUT --format hf`` wrote (``OUT/NAME``),
of :mod:`examples.lm_distill`'s or :mod:`examples.dpo`'s models (``--merge-lora`` for the DPO policy).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from examples.text import decode, encode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a save_pretrained folder written by `lightning-multids export --format hf`")
    parser.add_argument("prompt", help="the text to continue")
    parser.add_argument("--bytes", type=int, default=48, help="how many bytes to add")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.folder)
    with torch.no_grad():
        generated = model.generate(encode(args.prompt)[None], max_new_tokens=args.bytes, do_sample=False)
    print(f"{args.folder}: {decode(generated[0])!r}")


if __name__ == "__main__":
    main()
