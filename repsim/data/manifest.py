"""The shard manifest: ``manifest.parquet``, one row per sample the shard stage wrote, row number = ``index``.

Its name, columns (:data:`MANIFEST_SCHEMA`), writer and the one reader every module goes through
(:func:`read_manifest`, at a path or an fsspec URL), which names the file in a one-line DataError.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from repsim.data import remote
from repsim.errors import DataError, first_line

if TYPE_CHECKING:
    import pyarrow as pa

MANIFEST = "manifest.parquet"
MANIFEST_SCHEMA = {
    "index": "int64", "key": "string", "shard": "string", "split": "string", "label": "int64",
    "class_name": "string", "caption": "string", "sha256": "string", "width": "int32", "height": "int32",
    "source_id": "string",
}
FIX = "re-run the shard stage for its data spec, or point source.manifest at the manifest.parquet it wrote"


class ManifestWriter:
    """Writes ``manifest.parquet`` a table of rows at a time (a row group each, e.g. one tar's rows), so that
    memory holds one table however many samples there are; counts rows and splits."""

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.schema = manifest_schema()
        self.writer = pq.ParquetWriter(path, self.schema)
        self.rows, self.splits = 0, Counter()

    def __enter__(self) -> ManifestWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.close()

    def add(self, rows: pa.Table) -> None:
        """Write ``rows`` (of :data:`MANIFEST_SCHEMA`) after the rows added before."""
        self.writer.write_table(rows.cast(self.schema))
        self.rows += len(rows)
        self.splits.update(rows["split"].to_pylist())


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Manifest ``rows`` as a parquet file of :data:`MANIFEST_SCHEMA` (missing columns null), e.g. a piece's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows, schema=manifest_schema()), path)


def manifest_schema() -> pa.Schema:
    """:data:`MANIFEST_SCHEMA` as a pyarrow schema."""
    import pyarrow as pa

    return pa.schema([(name, pa.type_for_alias(kind)) for name, kind in MANIFEST_SCHEMA.items()])


def read_manifest(path: str | Path, columns: Sequence[str], filters: list[tuple[str, str, Any]] | None = None) -> pa.Table:
    """``columns`` of the manifest at ``path`` (a local path or an fsspec URL), in file order, ``filters`` as
    pyarrow.parquet.read_table takes them; DataError if it is missing, unreadable or lacks a column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    filesystem, inner = remote.filesystem(str(path))
    try:
        with remote.reaching(path), filesystem.open(inner, "rb") as file:
            names = pq.ParquetFile(file).schema_arrow.names
            wanted = [*columns, *(name for name, _, _ in filters or ())]
            missing = [name for name in dict.fromkeys(wanted) if name not in names]
            if missing:
                raise DataError(f"the manifest {path} has no column {', '.join(map(repr, missing))} "
                                f"(it has {', '.join(names) or 'none'})", FIX)
            return pq.read_table(file, columns=list(columns), filters=filters)
    except FileNotFoundError:
        raise DataError(f"the manifest {path} does not exist", FIX) from None
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"the manifest {path} is unreadable ({type(err).__name__}: {first_line(err)})", FIX) from None


def manifest_labels(manifest: str | Path) -> np.ndarray:
    """(N,) int64 labels of a shard manifest, in manifest order (-1 where a row has none)."""
    column = read_manifest(manifest, ["label"]).column("label").to_numpy(zero_copy_only=False)
    return np.nan_to_num(column.astype(np.float64), nan=-1).astype(np.int64)


def shard_sizes(manifest: Path | str) -> dict[str, int]:
    """Samples per tar name, counted from the manifest's ``shard`` column (a path or URL) by pyarrow (no row objects)."""
    counts = read_manifest(manifest, ["shard"]).column("shard").value_counts()
    return dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist()))
