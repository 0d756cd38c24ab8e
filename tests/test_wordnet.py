"""WordNet class similarities: the prepared NLTK corpus, the four measures, and helpful errors."""

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from repsim.errors import SimilarityError
from repsim.similarity.wordnet import (LEXICOGRAPHER_FILES, LEXNAMES_MAN_PAGE, MAX_DEPTH_FILE, class_similarity,
                                       gloss, lexicographer_files, lookup, noun_max_depth, prepare_wordnet,
                                       synsets_for, wordnet)

SPECS = Path(__file__).parent.parent / "data_specs"
WORDNET_30_NOUN_DEPTH = 19
ANIMALS = ["dog.n.01", "cat.n.01", "gym_shoe.n.01", "bear.n.01", "entity.n.01"]


@pytest.fixture(scope="module")
def prepared_home(tmp_path_factory):
    """One prepared corpus for the module, with the noun depth stored as a full scan would store it
    (the scan itself is checked by the slow test below)."""
    home = tmp_path_factory.mktemp("repsim_home")
    corpus = prepare_wordnet(data_root=home / "nltk_data")
    (corpus / MAX_DEPTH_FILE).write_text(str(WORDNET_30_NOUN_DEPTH))
    return home


@pytest.fixture(autouse=True)
def repsim_home(prepared_home, monkeypatch):
    """Share the module's prepared corpus instead of preparing one per test."""
    monkeypatch.setenv("REPSIM_HOME", str(prepared_home))
    return prepared_home


def test_prepared_corpus_has_lexnames_nltk_reads():
    lexnames = (prepare_wordnet() / "lexnames").read_text().splitlines()
    assert len(lexnames) == 45
    assert lexnames[0] == "00\tadj.all\t3" and lexnames[5] == "05\tnoun.animal\t1"
    assert lexnames[29] == "29\tverb.body\t2" and lexnames[44] == "44\tadj.ppl\t3"
    assert wordnet().synset("dog.n.01").lexname() == "noun.animal"
    assert wordnet() is wordnet()


@pytest.mark.skipif(not LEXNAMES_MAN_PAGE.exists(), reason="lexnames(5WN) man page not installed")
def test_man_page_table_matches_the_wordnet_30_list():
    assert lexicographer_files() == list(LEXICOGRAPHER_FILES)


def test_missing_debian_files_say_what_to_install(tmp_path):
    with pytest.raises(SimilarityError, match="apt-get install wordnet-base wordnet-sense-index") as err:
        prepare_wordnet(source=tmp_path / "nowhere", data_root=tmp_path / "nltk_data")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("measure", ["wup", "path", "lch", "hops"])
def test_matrix_is_symmetric_in_unit_range_with_unit_diagonal(measure):
    matrix = class_similarity(ANIMALS, measure)
    assert matrix.shape == (5, 5)
    assert np.array_equal(matrix, matrix.T)
    assert np.all(np.diag(matrix) == 1.0)
    assert matrix.min() >= 0 and matrix.max() <= 1
    off_diagonal = matrix[~np.eye(5, dtype=bool)]
    assert off_diagonal.max() < 1


@pytest.mark.parametrize("measure", ["wup", "path", "lch", "hops"])
def test_dog_is_closer_to_cat_than_to_a_sneaker(measure):
    matrix = class_similarity(["dog.n.01", "cat.n.01", "gym_shoe.n.01"], measure)
    assert matrix[0, 1] > matrix[0, 2]


def test_wup_and_path_equal_nltk():
    names = ["dog.n.01", "cat.n.01", "gym_shoe.n.01", "chef.n.01", "fireman.n.01", "einstein.n.01",
             "boot.n.01", "sandal.n.01", "jersey.n.03"]
    synsets = [wordnet().synset(name) for name in names]
    wup, path = class_similarity(names, "wup"), class_similarity(names, "path")
    for i, a in enumerate(synsets):
        for j, b in enumerate(synsets):
            if i != j:
                assert wup[i, j] == pytest.approx(a.wup_similarity(b), abs=1e-12)
                assert path[i, j] == pytest.approx(a.path_similarity(b), abs=1e-12)


def test_lch_and_hops_follow_their_normalisations():
    dog, cat = wordnet().synset("dog.n.01"), wordnet().synset("cat.n.01")
    hops = dog.shortest_path_distance(cat)
    two_d = 2 * WORDNET_30_NOUN_DEPTH
    assert class_similarity(["dog.n.01", "cat.n.01"], "lch")[0, 1] == pytest.approx(
        -math.log((hops + 1) / two_d) / math.log(two_d))
    assert class_similarity(["dog.n.01", "cat.n.01"], "hops")[0, 1] == pytest.approx(1 - hops / two_d)


def test_hops_similarity_falls_with_every_step_up_the_hierarchy():
    # the shortest path to the root: on a longer one (dog.n.01 also has a shortcut through
    # domestic_animal.n.01) an ancestor can be nearer than its place on the path
    shortest = min(wordnet().synset("dog.n.01").hypernym_paths(), key=len)
    chain = [s.name() for s in shortest[::-1]]
    assert len(chain) > 5
    first_row = class_similarity(chain, "hops")[0]
    assert np.all(np.diff(first_row) < 0)


@pytest.mark.slow
def test_noun_depth_scan_and_lch_match_nltk(tmp_path, monkeypatch):
    monkeypatch.setenv("REPSIM_HOME", str(tmp_path))
    assert noun_max_depth() == WORDNET_30_NOUN_DEPTH
    assert (prepare_wordnet() / MAX_DEPTH_FILE).read_text() == str(WORDNET_30_NOUN_DEPTH)
    dog, cat = wordnet().synset("dog.n.01"), wordnet().synset("cat.n.01")
    lch = class_similarity(["dog.n.01", "cat.n.01"], "lch")[0, 1]
    assert lch == pytest.approx(dog.lch_similarity(cat) / math.log(2 * WORDNET_30_NOUN_DEPTH))


def test_wrong_sense_number_lists_the_lemmas_senses_with_glosses():
    with pytest.raises(SimilarityError) as err:
        class_similarity(["dog.n.01", "bag.n.99"])
    message = str(err.value)
    assert "bag.n.99" in message and "bag.n.01 (a flexible container" in message
    assert "bag.n.04" in message and "\n" not in message


def test_unknown_lemma_suggests_close_spellings():
    with pytest.raises(SimilarityError, match="close spellings: zebra"):
        lookup("zebrra.n.01")


def test_verbs_are_refused_with_a_noun_hint():
    with pytest.raises(SimilarityError, match="must be nouns"):
        class_similarity(["dog.n.01", "run.v.01"])


def test_unknown_measure_lists_the_measures():
    with pytest.raises(SimilarityError, match="wup, path, lch, hops"):
        class_similarity(ANIMALS, "resnik")


def test_synsets_for_class_names():
    assert synsets_for("Dog")[0] == ("dog.n.01", gloss("dog.n.01"))
    assert ("boot.n.01", gloss("boot.n.01")) in synsets_for("Ankle boot")
    t_shirt = [name for name, _ in synsets_for("T-shirt/top")]
    assert t_shirt[0] == "jersey.n.03" and "top.n.01" in t_shirt
    assert synsets_for("qqqqqqqq") == []
    assert gloss("jersey.n.03") == "a close-fitting pullover shirt"


@pytest.mark.parametrize("spec", sorted(SPECS.glob("*.yaml")), ids=lambda path: path.stem)
def test_shipped_spec_synsets_exist(spec):
    classes = yaml.safe_load(spec.read_text())["classes"]
    for name, synset in classes.items():
        assert lookup(synset).pos() == "n", name
    assert class_similarity(list(classes.values())).shape == (len(classes),) * 2


def test_animal_mnist_wup_matrix_ranks_the_animals_as_expected():
    classes = yaml.safe_load((SPECS / "animal-mnist.yaml").read_text())["classes"]
    matrix = class_similarity(list(classes.values()), "wup")
    assert np.array_equal(matrix, matrix.T)
    assert np.all(np.diag(matrix) == 1.0)
    row = {name: i for i, name in enumerate(classes)}

    def similarity(a: str, b: str) -> float:
        return matrix[row[a], row[b]]

    assert similarity("horse", "zebra") > similarity("horse", "bird")
    assert similarity("dog", "cat") > similarity("dog", "elephant")
