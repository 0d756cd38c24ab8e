"""Caption embeddings: unit rows, each distinct text embedded once, order kept, meaning respected."""

import zlib

import numpy as np
import pyarrow as pa
import pytest

from repsim.errors import SimilarityError
from repsim.similarity.captions import embed_captions, load_text_model

CAPTIONS = ["a photo of a dog.", "a photo of a cat.", "a black and white photo of a sneaker.",
            "a photo of a dog.", "a low resolution photo of a sandal on the grass.", "a photo of a cat.",
            "a photo of a dog."]


class SpyModel:
    """Records every text it encodes; delegates to ``model`` or, without one, returns a fixed
    pseudo-random (not unit) vector per text."""

    def __init__(self, model=None, dim: int = 8):
        self.model, self.dim, self.seen, self.batches = model, dim, [], []

    def get_embedding_dimension(self) -> int:
        return self.model.get_embedding_dimension() if self.model else self.dim

    def encode(self, texts, **options):
        self.seen.extend(texts)
        self.batches.append(list(texts))
        if self.model:
            return self.model.encode(texts, **options)
        return np.stack([np.random.default_rng(zlib.crc32(text.encode())).normal(size=self.dim) * 3
                         for text in texts])


def reference(texts, dim=8):
    rows = np.stack([np.random.default_rng(zlib.crc32(text.encode())).normal(size=dim) for text in texts])
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_each_distinct_text_is_encoded_once_and_scattered_back_in_order():
    spy = SpyModel()
    embeddings = embed_captions(CAPTIONS, model=spy, batch_size=2)
    assert sorted(spy.seen) == sorted(set(CAPTIONS))
    assert embeddings.shape == (7, 8) and embeddings.dtype == np.float32
    np.testing.assert_allclose(embeddings, reference(CAPTIONS), atol=1e-6)
    assert np.array_equal(embeddings[0], embeddings[3]) and np.array_equal(embeddings[0], embeddings[6])


def test_batches_run_longest_first():
    spy = SpyModel()
    embed_captions(CAPTIONS, model=spy, batch_size=2)
    lengths = [len(text) for batch in spy.batches for text in batch]
    assert lengths == sorted(lengths, reverse=True)
    assert [len(batch) for batch in spy.batches] == [2, 2]


def test_rows_are_unit_norm_and_can_fill_a_float16_memmap(tmp_path):
    out = np.lib.format.open_memmap(tmp_path / "captions.npy", mode="w+", dtype=np.float16, shape=(7, 8))
    returned = embed_captions(CAPTIONS, model=SpyModel(), batch_size=3, out=out)
    assert returned is out
    out.flush()
    stored = np.load(tmp_path / "captions.npy")
    np.testing.assert_allclose(np.linalg.norm(stored.astype(np.float32), axis=1), 1, atol=2e-3)
    np.testing.assert_allclose(stored, reference(CAPTIONS), atol=2e-3)


def test_no_captions_is_a_one_line_error():
    with pytest.raises(SimilarityError, match="no captions to embed; pass at least one caption") as err:
        embed_captions([], model=SpyModel())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("column", [list, lambda texts: pa.array(texts, pa.string())])
def test_a_caption_that_is_not_text_is_named(column):
    with pytest.raises(SimilarityError, match="caption 1 is NoneType, not a string"):
        embed_captions(column(["a photo of a dog.", None]), model=SpyModel())


def test_a_pyarrow_column_embeds_like_the_same_list():
    texts = ["a cat.", "a dog.", "a cat.", "a bird.", "a dog."]
    np.testing.assert_array_equal(embed_captions(pa.chunked_array([texts[:2], texts[2:]]), model=SpyModel()),
                                  embed_captions(texts, model=SpyModel()))


@pytest.mark.slow
def test_a_missing_model_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(SimilarityError, match="cannot load text model") as err:
        load_text_model(tmp_path / "no-model", device="cpu")
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def minilm():
    return load_text_model(device="cpu")


@pytest.mark.slow
def test_minilm_rows_are_unit_and_match_sentence_transformers(minilm):
    embeddings = embed_captions(CAPTIONS, model=minilm)
    assert embeddings.shape == (7, 384)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-5)
    direct = minilm.encode(CAPTIONS, normalize_embeddings=True)
    np.testing.assert_allclose(embeddings, direct, atol=1e-5)
    assert load_text_model(device="cpu") is minilm


@pytest.mark.slow
def test_repeats_equal_the_unique_embeddings_scattered_back(minilm):
    unique = sorted(set(CAPTIONS))
    spy = SpyModel(minilm)
    with_repeats = embed_captions(CAPTIONS, model=spy)
    assert len(spy.seen) == len(unique)
    unique_rows = embed_captions(unique, model=minilm)
    np.testing.assert_allclose(with_repeats, unique_rows[[unique.index(text) for text in CAPTIONS]], atol=1e-6)


@pytest.mark.slow
def test_a_paraphrase_is_closer_than_an_unrelated_sentence(minilm):
    anchor, paraphrase, unrelated = embed_captions(
        ["a dog runs across the park.", "a puppy is running through a park.",
         "the stock market fell sharply on monday."], model=minilm)
    assert anchor @ paraphrase > anchor @ unrelated + 0.3
