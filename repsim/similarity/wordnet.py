"""WordNet class similarities from the Debian WordNet 3.0 files, read with NLTK.

Debian's ``wordnet-base`` and ``wordnet-sense-index`` omit the ``lexnames`` file NLTK needs, so
:func:`prepare_wordnet` copies the database once into ``$REPSIM_HOME/nltk_data/corpora/wordnet/`` (NLTK
reads only below its data path) with a ``lexnames`` rebuilt from the ``lexnames(5WN)`` man page.

Measures on the noun hierarchy, with d the shortest hypernym/hyponym path between two synsets and D the
deepest noun (19 in WordNet 3.0), all in [0, 1] with the diagonal exactly 1:

- ``wup``: NLTK's Wu-Palmer, the mean of both argument orders (NLTK's differs in rare ties).
- ``path``: ``1 / (1 + d)``, NLTK's ``path_similarity``.
- ``lch``: Leacock-Chodorow over its maximum, ``1 - log(1 + d) / log(2D)``, clipped at 0.
- ``hops``: ``1 - d / 2D``, linear in the hop count (2D bounds any path through the root).
"""

from __future__ import annotations

import difflib
import functools
import gzip
import math
import os
import re
import shutil
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from repsim.errors import SimilarityError
from repsim.stage import repsim_home

DEBIAN_WORDNET = Path("/usr/share/wordnet")
LEXNAMES_MAN_PAGE = Path("/usr/share/man/man5/lexnames.5WN.gz")
DATABASE_FILES = ("cntlist.rev", "index.sense", "index.adj", "index.adv", "index.noun", "index.verb",
                  "data.adj", "data.adv", "data.noun", "data.verb",
                  "adj.exc", "adv.exc", "noun.exc", "verb.exc")
INSTALL_FIX = "install it with `apt-get install wordnet-base wordnet-sense-index`"
MEASURES = ("wup", "path", "lch", "hops")
MAX_DEPTH_FILE = "repsim_noun_max_depth"

LEXICOGRAPHER_FILES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl")
POS_NUMBERS = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def nltk_data_root() -> Path:
    """``$REPSIM_HOME/nltk_data``: the NLTK data folder repsim prepares and reads."""
    return repsim_home() / "nltk_data"


def lexicographer_files(man_page: Path = LEXNAMES_MAN_PAGE) -> list[str]:
    """The 45 lexicographer file names in file-number order: from the ``lexnames(5WN)`` table when the
    man page is installed and complete, else the fixed WordNet 3.0 list."""
    if not man_page.exists():
        return list(LEXICOGRAPHER_FILES)
    with gzip.open(man_page, "rt") as page:
        rows = sorted(re.findall(r"^(\d\d)\t(\S+)", page.read(), flags=re.MULTILINE))
    if [int(number) for number, _ in rows] != list(range(len(LEXICOGRAPHER_FILES))):
        return list(LEXICOGRAPHER_FILES)
    return [name for _, name in rows]


def lexnames_text(names: Sequence[str]) -> str:
    """NLTK's ``lexnames``: ``NN<TAB>name<TAB>pos-number`` per line."""
    return "".join(f"{number:02d}\t{name}\t{POS_NUMBERS[name.split('.')[0]]}\n"
                   for number, name in enumerate(names))


def prepare_wordnet(source: Path = DEBIAN_WORDNET, data_root: Path | None = None) -> Path:
    """Copy the WordNet database into ``<data_root>/corpora/wordnet`` (default :func:`nltk_data_root`) with
    ``lexnames``, once, under a temporary name then renamed (never half-prepared); return the folder."""
    target = (data_root or nltk_data_root()) / "corpora" / "wordnet"
    if target.exists():
        return target
    missing = [name for name in DATABASE_FILES if not (source / name).is_file()]
    if missing:
        raise SimilarityError(f"the WordNet database is missing from {source} ({', '.join(missing)})",
                              INSTALL_FIX)
    building = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    building.mkdir(parents=True)
    for name in DATABASE_FILES:
        shutil.copyfile(source / name, building / name)
    (building / "lexnames").write_text(lexnames_text(lexicographer_files()))
    try:
        building.rename(target)
    except OSError:
        shutil.rmtree(building)
    return target


@functools.cache
def _reader(data_root: str):
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    if data_root not in nltk.data.path:
        nltk.data.path.append(data_root)  # NLTK opens files, and finds corpora/wordnet, only there
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The multilingual functions")
        return WordNetCorpusReader(str(Path(data_root) / "corpora" / "wordnet"), None)


def wordnet():
    """The NLTK WordNet reader over the prepared corpus (prepared on first use; one per process)."""
    prepare_wordnet()
    return _reader(str(nltk_data_root()))


def gloss(synset: str) -> str:
    """The definition of a synset, e.g. ``gloss("bag.n.04")``."""
    return lookup(synset).definition()


def synsets_for(name: str, pos: str | None = "n") -> list[tuple[str, str]]:
    """Candidate ``(synset, gloss)`` pairs for a class name: the whole name as a lemma (``"Ankle boot"`` ->
    ``ankle_boot``), else its ``/`` parts (``"T-shirt/top"``), else its words, last (the head) first."""
    reader = wordnet()
    phrase = re.sub(r"\s+", "_", name.strip().lower())
    parts = [part for part in phrase.split("/") if part]
    words = [word for part in parts for word in re.split(r"[_\s]+", part) if word][::-1]
    for attempt in ([phrase], parts, words):
        found = list(dict.fromkeys(s for lemma in attempt for s in reader.synsets(lemma, pos=pos)))
        if found:
            return [(s.name(), s.definition()) for s in found]
    return []


def lookup(name: str):
    """The NLTK synset called ``name`` (e.g. ``"dog.n.01"``); an unknown name raises an error that
    lists the valid senses of its lemma, or lemmas spelled like it."""
    from nltk.corpus.reader.wordnet import WordNetError

    try:
        return wordnet().synset(name)
    except (WordNetError, ValueError):
        raise SimilarityError(f"unknown WordNet synset {name!r}", _suggestion(name)) from None


def _suggestion(name: str) -> str:
    lemma, _, pos = name.partition(".")
    pos = pos.partition(".")[0] or "n"
    known_pos = pos if pos in {"n", "v", "a", "s", "r"} else None
    senses = synsets_for(lemma, pos=known_pos) or synsets_for(lemma, pos=None)
    if senses:
        listed = ", ".join(f"{synset} ({_short(text)})" for synset, text in senses[:8])
        return f"did you mean one of: {listed}"
    close = difflib.get_close_matches(lemma.lower(), list(wordnet().all_lemma_names(pos="n")), n=5)
    if close:
        return f"no lemma {lemma!r}; close spellings: {', '.join(close)} (see repsim.similarity.synsets_for)"
    return f"no lemma like {lemma!r}; write synsets as lemma.n.NN (see repsim.similarity.synsets_for)"


def _short(text: str, limit: int = 50) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def noun_max_depth() -> int:
    """D: the longest hypernym path from any noun synset to the root (19 in WordNet 3.0), stored beside the
    prepared corpus (scanning every noun takes seconds)."""
    stored = prepare_wordnet() / MAX_DEPTH_FILE
    if stored.exists():
        return int(stored.read_text())
    depth = max(synset.max_depth() for synset in wordnet().all_synsets("n"))
    partial = stored.with_name(f".{MAX_DEPTH_FILE}.{uuid.uuid4().hex}")
    partial.write_text(str(depth))
    os.replace(partial, stored)
    return depth


@functools.cache
def _ancestors(synset) -> dict:
    """Hops from ``synset`` to each of its hypernyms (itself at 0), found breadth first."""
    hops: dict = {}
    queue = deque([(synset, 0)])
    while queue:
        node, distance = queue.popleft()
        if node not in hops:
            hops[node] = distance
            queue.extend((parent, distance + 1) for parent in node.hypernyms() + node.instance_hypernyms())
    return hops


def _path_length(a, b) -> int:
    """Shortest path length (hops along hypernym/hyponym links) between synsets, as NLTK's
    ``shortest_path_distance``: through the common ancestor that minimises the sum of hops."""
    up_a, up_b = _ancestors(a), _ancestors(b)
    return min(up_a[common] + up_b[common] for common in up_a.keys() & up_b.keys())


def _wup(a, b) -> float:
    """NLTK's ``wup_similarity``: the subsumer is the common hypernym of greatest minimum depth
    (``a`` itself if it qualifies, else the first by name)."""
    common = _ancestors(a).keys() & _ancestors(b).keys()
    deepest = max(s.min_depth() for s in common)
    subsumer = a if a in common and a.min_depth() == deepest else min(
        (s for s in common if s.min_depth() == deepest), key=lambda s: s.name())
    depth = subsumer.max_depth() + 1
    return 2.0 * depth / (_path_length(a, subsumer) + _path_length(b, subsumer) + 2 * depth)


def _pair_measure(measure: str) -> Callable:
    """``f(a, b) -> similarity`` for one measure."""
    if measure == "wup":
        return lambda a, b: (_wup(a, b) + _wup(b, a)) / 2
    if measure == "path":
        return lambda a, b: 1.0 / (1 + _path_length(a, b))
    two_d = 2 * noun_max_depth()
    if measure == "lch":
        return lambda a, b: max(0.0, 1 - math.log(1 + _path_length(a, b)) / math.log(two_d))
    return lambda a, b: 1 - _path_length(a, b) / two_d


def class_similarity(synsets: Sequence[str], measure: str = "wup", progress: bool = False) -> np.ndarray:
    """(C, C) float64 ``measure`` similarity (see the module docstring) between class synsets."""
    if measure not in MEASURES:
        raise SimilarityError(f"unknown WordNet measure {measure!r}", f"use one of {', '.join(MEASURES)}")
    nodes = [lookup(name) for name in synsets]
    verbs = [name for name, node in zip(synsets, nodes) if node.pos() != "n"]
    if verbs:
        raise SimilarityError(f"class synsets must be nouns, not {', '.join(verbs)}",
                              "choose a noun sense (lemma.n.NN); see repsim.similarity.synsets_for")
    similarity = _pair_measure(measure)
    matrix = np.eye(len(nodes))
    for i in tqdm(range(len(nodes)), desc=f"wordnet {measure}", disable=not progress):
        for j in range(i + 1, len(nodes)):
            matrix[i, j] = matrix[j, i] = similarity(nodes[i], nodes[j])
    return matrix
