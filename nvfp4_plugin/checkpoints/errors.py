"""Checkpoint problems: each names the file, the tensor (or config field), what was expected and what was found."""

from __future__ import annotations

from dataclasses import dataclass

#: How many problems one error message lists before summarizing the rest.
MAX_LISTED_PROBLEMS = 20


@dataclass(frozen=True)
class Problem:
    file: str | None
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.file:
            where.append(self.file)
        if self.tensor:
            where.append(f"tensor '{self.tensor}'")
        return f"{': '.join(where)}: {self.message}" if where else self.message


class CheckpointError(ValueError):
    """A checkpoint (or its config) cannot be used. ``problems`` lists every problem found."""

    def __init__(self, problems, context: str | None = None):
        if isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        self.context = context
        head = f"{context}: " if context else ""
        n = len(self.problems)
        if n == 1:
            msg = head + str(self.problems[0])
        else:
            lines = [f"{head}{n} problems:"] + [f"  - {p}" for p in self.problems[:MAX_LISTED_PROBLEMS]]
            if n > MAX_LISTED_PROBLEMS:
                lines.append(f"  ... and {n - MAX_LISTED_PROBLEMS} more")
            msg = "\n".join(lines)
        super().__init__(msg)


def problem(file, tensor, message) -> Problem:
    return Problem(str(file) if file is not None else None, tensor, message)


class ProblemCollector:
    """Accumulates problems so that one pass reports all of them, then raises once."""

    def __init__(self, context: str | None = None):
        self.problems: list[Problem] = []
        self.context = context

    def add(self, file, tensor, message) -> None:
        self.problems.append(problem(file, tensor, message))

    def __bool__(self) -> bool:
        return bool(self.problems)

    def raise_if_any(self) -> None:
        if self.problems:
            raise CheckpointError(self.problems, self.context)


class MissingDependency(RuntimeError):
    """An optional package a tool needs (transformers, tokenizers) is not installed."""


def require(module: str, what: str, hint: str = ""):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(f"{what} needs the '{module}' package (pip install {module}){hint}") from exc
