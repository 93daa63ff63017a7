"""The statements every request runs, executed on the database driver directly.

SQLAlchemy Core spends 20-40 µs of Python on each execution (building an execution context, events, result
wrapping): more than SQLite takes to run most of the coordinator's statements, and a dozen of them serve one
submission. A `Prepared` statement is compiled once per dialect by SQLAlchemy itself, so its SQL is exactly what
`Connection.execute` would send, and each run only applies the columns' own type processors (JSON through the
engine's serializer, booleans, ...) and calls the driver's cursor, inside the same transaction. Results are plain
tuples, or typed rows (`first_as`, `all_as`). Statements with expanding IN lists are not supported: those go
through `Connection.execute`, like everything that is not on every request's path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement

T = TypeVar("T")


@dataclass(frozen=True)
class _Plan:
    sql: str
    order: tuple[str, ...] | None  # parameter names in position order (qmark drivers); None: named parameters
    defaults: dict[str, Any]  # literal values the statement binds itself, and None for each parameter
    binds: dict[str, Callable[[Any], Any]]
    types: tuple[Any, ...]  # the result columns' SQLAlchemy types
    columns: tuple[str, ...]
    # Positional drivers: the parameter values in position order, from the name -> value mapping.
    positions: Callable[[dict[str, Any]], tuple[Any, ...]] | None = None
    # The result columns that have processors, as (index, processor), made from the first cursor: some drivers'
    # processors depend on the type code the database reports (PostgreSQL numerics).
    results: list[tuple[tuple[int, Callable[[Any], Any]], ...]] = field(default_factory=list)


class Prepared:
    """`stmt` (a Core statement with `bindparam`s), run on the driver of the transaction it is given."""

    def __init__(self, stmt: ClauseElement, keys: Sequence[str] | None = None):
        self.stmt, self.keys = stmt, list(keys) if keys is not None else None
        self._plans: dict[int, _Plan] = {}

    def _plan(self, dialect: Dialect) -> _Plan:
        plan = self._plans.get(id(dialect))
        if plan is None:
            compiled = self.stmt.compile(dialect=dialect, column_keys=self.keys)
            order = tuple(compiled.positiontup) if compiled.positional else None
            defaults, binds = dict(compiled.construct_params(_check=False)), dict(compiled._bind_processors)
            plan = _Plan(sql=compiled.string, order=order, defaults=defaults, binds=binds,
                         types=tuple(rc[3] for rc in compiled._result_columns),
                         columns=tuple(rc[0] for rc in compiled._result_columns),
                         positions=None if order is None else _getter(order))
            self._plans[id(dialect)] = plan  # the engine's dialect lives as long as the engine
        return plan

    @staticmethod
    def _values(plan: _Plan, params: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        values = {**plan.defaults, **params}
        for name, process in plan.binds.items():
            values[name] = process(values[name])
        return values if plan.positions is None else plan.positions(values)

    def _run(self, tx: Connection, params: Mapping[str, Any]) -> tuple[Any, _Plan]:
        plan = self._plan(tx.dialect)
        cursor = tx.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        cursor.execute(plan.sql, self._values(plan, params))
        if plan.types and not plan.results:
            processors = (t._cached_result_processor(tx.dialect, d[1])
                          for t, d in zip(plan.types, cursor.description, strict=True))
            plan.results.append(tuple((i, p) for i, p in enumerate(processors) if p is not None))
        return cursor, plan

    @staticmethod
    def _typed(plan: _Plan, row: Sequence[Any]) -> tuple[Any, ...]:
        processors = plan.results[0]
        if not processors:
            return tuple(row)
        typed = list(row)
        for i, process in processors:
            if typed[i] is not None:
                typed[i] = process(typed[i])
        return tuple(typed)

    def all(self, tx: Connection, **params: Any) -> list[tuple[Any, ...]]:
        cursor, plan = self._run(tx, params)
        return [self._typed(plan, r) for r in cursor.fetchall()]

    def first(self, tx: Connection, **params: Any) -> tuple[Any, ...] | None:
        cursor, plan = self._run(tx, params)
        row = cursor.fetchone()
        cursor.close()
        return None if row is None else self._typed(plan, row)

    def scalar(self, tx: Connection, **params: Any) -> Any:
        """The first column of the first row (None when there is none)."""
        row = self.first(tx, **params)
        return None if row is None else row[0]

    def many(self, tx: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Run the statement once per parameter set in `rows` (the driver's executemany)."""
        plan = self._plan(tx.dialect)
        batch = [self._values(plan, params) for params in rows]
        tx.connection.dbapi_connection.cursor().executemany(plan.sql, batch)  # type: ignore[union-attr]

    def rowcount(self, tx: Connection, **params: Any) -> int:
        cursor, _ = self._run(tx, params)
        return cursor.rowcount

    def all_as(self, cls: type[T], tx: Connection, **params: Any) -> list[T]:
        """Rows as `cls`, a dataclass whose fields are among the statement's columns."""
        cursor, plan = self._run(tx, params)
        index = _indexes(cls, plan)
        return [cls(*(typed[i] for i in index)) for typed in (self._typed(plan, r) for r in cursor.fetchall())]

    def first_as(self, cls: type[T], tx: Connection, **params: Any) -> T | None:
        row = self.first(tx, **params)
        return None if row is None else cls(*(row[i] for i in _indexes(cls, self._plan(tx.dialect))))

    def first_as_with(self, cls: type[T], tx: Connection, **params: Any) -> tuple[T, tuple[Any, ...]] | None:
        """The first row as `cls`, and the whole row (for the columns `cls` does not hold)."""
        row = self.first(tx, **params)
        return None if row is None else (cls(*(row[i] for i in _indexes(cls, self._plan(tx.dialect)))), row)


def _getter(order: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """values -> the values of `order`, as a tuple (in C: `itemgetter`)."""
    if len(order) > 1:
        return operator.itemgetter(*order)
    if order:
        only = order[0]
        return lambda values: (values[only],)
    return lambda values: ()


_INDEXES: dict[tuple[type, tuple[str, ...]], tuple[int, ...]] = {}


def _indexes(cls: type, plan: _Plan) -> tuple[int, ...]:
    key = (cls, plan.columns)
    found = _INDEXES.get(key)
    if found is None:
        found = _INDEXES[key] = tuple(plan.columns.index(f.name) for f in fields(cls))  # type: ignore[arg-type]
    return found
