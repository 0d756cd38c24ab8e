"""Typed errors whose message says what went wrong and how to fix it, in one line."""


class RepsimError(Exception):
    """A user-facing error: ``<what>; <how to fix>``. The CLI prints it and exits 2."""

    def __init__(self, what: str, fix: str = ""):
        self.what = what
        self.fix = fix
        super().__init__(f"{what}; {fix}" if fix else what)


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name when it has none: a cause to quote."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


class SpecError(RepsimError):
    """A data spec or config is malformed or points at something that does not exist."""


class DataError(RepsimError):
    """Source data is missing, unreadable or inconsistent."""


class StageError(RepsimError):
    """A stage output directory is not what the cache contract expects."""


class EvalError(RepsimError):
    """Features, labels or embeddings given to an evaluation are unusable (shape, count, NaN)."""


class SimilarityError(RepsimError):
    """A similarity source or neighbor list cannot be built from what it was given."""
