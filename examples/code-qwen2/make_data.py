"""Write the JSONL code set of this example: programs that read an integer and print it plus, minus or times a
number given in the prompt, each asked in six phrasings, with a stdin/stdout test case and a reference program,
shuffled with a fixed seed (the same bytes on every machine, which swarm.toml pins by sha256).

    python make_data.py            # -> data/code.jsonl next to this script
    python make_data.py --dir DIR  # -> DIR/data/code.jsonl

Each line is {"prompt": ..., "tests": [{"input": "17\\n", "output": "40\\n"}], "solution": ...}, what the
`code` task reads: the tests are the problem's answer (they never leave the trusted side), and the solution is
only what the supervised warm start teaches. One case per problem, with an input that tells the three operations
apart: every rollout's program runs once per case in a fresh sandbox, the cost that bounds a step on a small
machine. Prints the file's path, sha256 and problem count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import operator
import random
from pathlib import Path

OPERATIONS = {"+": (operator.add, ["plus", "increased by"]), "-": (operator.sub, ["minus", "decreased by"]),
              "*": (operator.mul, ["times", "multiplied by"])}
PHRASINGS = ["Read an integer from standard input and print it {word} {k}.",
             "Write a program that reads a number n and prints n {word} {k}.",
             "Print the input number {word} {k}."]
LARGEST = 60
SEED = 0


def problems() -> list[dict[str, object]]:
    """Every (operation, k, wording, phrasing), with its test input drawn from a seeded generator, shuffled."""
    rng = random.Random(SEED)
    out: list[dict[str, object]] = []
    for symbol, (apply, words) in OPERATIONS.items():
        for k in range(1, LARGEST + 1):
            for word in words:
                for phrasing in PHRASINGS:
                    x = rng.randint(3, 99)  # x + k, x - k and x * k differ for x >= 3
                    tests = [{"input": f"{x}\n", "output": f"{apply(x, k)}\n"}]
                    out.append({"prompt": phrasing.format(word=word, k=k), "tests": tests,
                                "solution": f"print(int(input()){symbol}{k})"})
    rng.shuffle(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent,
                        help="the data directory of the run (data/code.jsonl is written inside)")
    args = parser.parse_args()
    rows = problems()
    data = "".join(json.dumps(p) + "\n" for p in rows).encode()
    path = args.dir / "data" / "code.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    print(f"{path} sha256={hashlib.sha256(data).hexdigest()} problems={len(rows)}")


if __name__ == "__main__":
    main()
