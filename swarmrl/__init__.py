"""swarmrl: RL post-training of language models on untrusted, decentralised compute.

Everything installs under this one name. Each role keeps its own top-level folder in the repository
(`protocol/`, `transfer/`, `runtime/`, `models/`, `pools/`, `node/`, `coordinator/`, `verifier/`,
`trainer/`, `testing/`, `tasks/`) and is installed as `swarmrl.<folder>` (pyproject.toml's package-dir maps each
package to its folder), so no top-level name of ours can collide with another distribution's. A checkout is used
through an install, editable for development (`pip install -e .`, as scripts/install.sh does): the install is what
maps `swarmrl.<folder>` to the folder, and each module is imported once, under one name.
"""

__version__ = "0.1.0"
