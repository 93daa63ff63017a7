"""Write the JSONL math set of this example: sums and products of two numbers from 0 to 12, each asked in five
phrasings, shuffled with a fixed seed (the same bytes on every machine, which swarm.toml pins by sha256).

    python make_data.py            # -> data/math.jsonl next to this script
    python make_data.py --dir DIR  # -> DIR/data/math.jsonl

Each line is {"question": ..., "answer": ...}, what the `math` task reads; the held-out split (a quarter of the
problems, chosen by the task's split_seed) has other problems than training, though often the same facts asked
another way. Prints the file's path, sha256 and problem count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

TEMPLATES = {
    "+": ["What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?", "Compute {a} + {b}.",
          "{a} plus {b} equals what?"],
    "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is the product of {a} and {b}?",
          "Compute {a} * {b}.", "{a} times {b} equals what?"],
}
LARGEST = 12
SEED = 0


def problems() -> list[dict[str, str]]:
    """Every (operation, a, b, phrasing), in a fixed shuffled order."""
    out = []
    for op, phrasings in TEMPLATES.items():
        for a in range(LARGEST + 1):
            for b in range(LARGEST + 1):
                value = a + b if op == "+" else a * b
                out += [{"question": p.format(a=a, b=b), "answer": str(value)} for p in phrasings]
    random.Random(SEED).shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent,
                        help="the data directory of the run (data/math.jsonl is written inside)")
    args = parser.parse_args()
    rows = problems()
    data = "".join(json.dumps(p) + "\n" for p in rows).encode()
    path = args.dir / "data" / "math.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    print(f"{path} sha256={hashlib.sha256(data).hexdigest()} problems={len(rows)}")


if __name__ == "__main__":
    main()
