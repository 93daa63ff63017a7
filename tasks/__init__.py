"""The built-in tasks, registered in the `swarmrl.tasks` entry-point group like any third-party task.

- `addition` (alias `addition3`, `swarmrl.tasks.addition`): `123+456=` -> `579`, the demo's task.
- `math` (`swarmrl.tasks.math`): questions with final answers from a JSONL file; answers are compared for
  mathematical equivalence by math-verify (sympy underneath).
- `code` (`swarmrl.tasks.code`): programming problems with stdin/stdout test cases from a JSONL file; every
  completion runs in a bubblewrap sandbox (`swarmrl.tasks.sandbox`).
- `reasoning_gym` (`swarmrl.tasks.reasoninggym`): a weighted mixture of reasoning-gym's procedural generators,
  regenerated on every role from the run's signed options (no data file), scored by reasoning-gym's own scorers.

The interface they implement, and how to write another, is in `swarmrl.protocol.tasks`.
"""
