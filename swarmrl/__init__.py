"""swarmrl: RL post-training of language models on untrusted, decentralised compute.

Everything installs under this one name. Each role keeps its own top-level folder in the repository
(`protocol/`, `transfer/`, `runtime/`, `models/`, `pools/`, `node/`, `coordinator/`, `verifier/`,
`trainer/`, `testing/`, `tasks/`) and is installed as `swarmrl.<folder>` (pyproject.toml maps each
package to its folder), so no top-level name of ours can collide with another distribution's. In a
source checkout that is not installed (or not this one: a second worktree), the folders beside this
package are found through `__path__` below.
"""

import os as _os

__version__ = "0.1.0"

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_ROOT, "protocol", "__init__.py")):
    __path__.append(_ROOT)  # noqa: F821 (a package's __path__ is defined by the import system)
