"""Why a pool cannot be listed or joined (light to import: no hivemind)."""


class PoolLookupError(RuntimeError):
    """The pools' DHT could not be read (no bootstrap peers, or none reachable)."""


class PoolChoiceError(RuntimeError):
    """No pool can be joined under the name asked for; the message says why and what to do."""


class PoolKeyChanged(PoolChoiceError):
    """The pool asked for is announced under another key than the one this node pinned when it first joined: no
    waiting changes that, only its operator can (the message says how)."""
