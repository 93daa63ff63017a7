"""Pydantic's reasons in words: the one formatter of validation errors, for refusals, configs and parsed records.

    describe_validation_error(e)                       # "lease.seed: Input should be a valid integer; ..."
    describe_validation_error(e, root="header", limit=3)

Input values are left out: they may be huge (a whole page that a URL answered with) or secret.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

ErrorHint = Callable[[Mapping[str, Any]], str | None]
"""Given one error (pydantic's dict), a replacement of its message, or None to keep pydantic's."""


def describe_validation_error(errors: Any, *, limit: int | None = 5, root: str = "body", sep: str = "; ",
                              hint: ErrorHint | None = None) -> str:
    """`errors` (a pydantic ValidationError, FastAPI's RequestValidationError, or their `.errors()` list) as
    `dotted.location: message` parts joined by `sep`: the first `limit` of them (None: all), then "... and N more".
    An error without a location is named `root`; `hint` may reword an error's message (e.g. add "did you mean")."""
    items: Sequence[Mapping[str, Any]] = errors.errors() if hasattr(errors, "errors") else errors
    shown = items if limit is None else items[:limit]
    parts = []
    for err in shown:
        loc = ".".join(str(p) for p in err.get("loc", ())) or root
        parts.append(f"{loc}: {(hint(err) if hint else None) or err.get('msg', 'invalid')}")
    if len(items) > len(shown):
        parts.append(f"... and {len(items) - len(shown)} more")
    return sep.join(parts)
