"""The align stage: GeRA (or contrastive alignment alone, alpha = 0) between frozen image and text
embeddings of the cached embedding tables, with ASIF as the training-free baseline. It writes the
pairing and neighbors, ``alignment.pt`` (:func:`repsim.align.method.load_alignment`), ``metrics.jsonl``,
``loss.png`` and ``results.json`` on the test split (or the ``data.holdout`` part of the train split),
and resumes an interrupted run from ``$REPSIM_HOME/scratch/align/<key>/``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from repsim.align.config import AlignConfig
from repsim.align.evaluate import Map, network_map, score_space
from repsim.align.pairing import NEIGHBOUR_FILES, draw_pairing, neighbor_lists
from repsim.align.tables import EmbeddingTables, embedding_tables, embedding_tables_stage_of, hold_out, load_tables
from repsim.align.method import ALIGNMENT_FILE, AlignmentMethod, PairedBatches, save_alignment
from repsim.align.asif import ASIF
from repsim.data.stage import ShardResult, sharded, sharded_already
from repsim.data.spec import DataSpec, load_spec
from repsim.device import resolve_device
from repsim.methods.stage import CHECKPOINT_FILE, METRICS_FILE, JsonlMetrics, _tee, summarise
from repsim.methods.trainer import LogFn, Trainer, seeded
from repsim.layering import keyed_values
from repsim.stage import SERVE_COMPLETE, Reuse, Stage, StageKind, StageOutput, run_stage, scratch_folder

VERSION = "1"
RESULTS_FILE = "results.json"
LOSS_PLOT_FILE = "loss.png"
CURVES = ("loss", "contrastive", "geo_a", "geo_b")

__all__ = ["align", "align_scores", "align_stage_of"]


def align_stage_of(config: AlignConfig, shards: ShardResult | str | Path | None = None,
                   device: str | torch.device | None = None) -> Stage:
    """The align stage of ``config`` (and thus its key) without running it. ``shards`` defaults to the
    completed shard output of the config's data spec (StageError if it has not been sharded)."""
    spec = load_spec(config.data.spec)
    shards = sharded_already(spec, shards)
    keys = [embedding_tables_stage_of(shards, config.image, config.text, split, device).key
            for split in (config.data.train_split, config.data.test_split)]
    return _stage(config, *keys)


def _stage(config: AlignConfig, train_key: str, test_key: str) -> Stage:
    return Stage("align", VERSION, keyed_values(config),
                 {"train_tables": train_key, "test_tables": test_key})


def align(config: AlignConfig, out_dir: str | Path | None = None, log: LogFn | None = None,
          shards: ShardResult | str | Path | None = None, device: str | torch.device | None = None,
          progress: bool = True, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """Align ``config`` into its stage directory (f and g trained on ``device``, default the GPU when
    present), or return the cached output at once; ``log(metrics, step)`` receives the per-step curves.
    ``reuse`` serves complete outputs, of its embedding tables too."""
    spec = load_spec(config.data.spec)
    shards = sharded(spec, shards, progress)
    train_tables, test_tables = (embedding_tables(shards, spec, config.image, config.text, split, device,
                                                  progress=progress, reuse=reuse)
                                 for split in (config.data.train_split, config.data.test_split))
    stage = _stage(config, train_tables.key, test_tables.key)
    train, test = load_tables(train_tables), load_tables(test_tables)
    if config.data.holdout:
        train, test = hold_out(train, config.data.holdout)
    with scratch_folder(stage) as scratch:
        build = functools.partial(_build, config, spec, train, test, scratch, log, resolve_device(device), progress)
        return run_stage(stage, build, out_dir, reuse=reuse)


def _build(config: AlignConfig, spec: DataSpec, train: EmbeddingTables, test: EmbeddingTables, scratch: Path,
           log: LogFn | None, device: torch.device, progress: bool, out: Path) -> dict[str, float]:
    """Pair, train f and g (resuming from ``scratch``), score them and ASIF on ``test``: the align stage's outputs."""
    pairing = draw_pairing(len(train.indices), config.pairing.pairs, config.pairing.unpaired, config.pairing.seed)
    pairing.save(out)
    neighbors = {modality: neighbor_lists(table, pairing.paired, pool, config.neighbors.count, config.neighbors.index)
                 for modality, table, pool in (("image", train.image, pairing.unpaired_image),
                                               ("text", train.text, pairing.unpaired_text))}
    for modality, ids in neighbors.items():
        np.save(out / NEIGHBOUR_FILES[modality], ids)
    with seeded(config.optim.seed):
        method = AlignmentMethod(train.image.shape[1], train.text.shape[1], config)
    batches = PairedBatches(train.image, train.text, pairing.paired, neighbors["image"], neighbors["text"],
                            config.geometry, config.optim.batch_size, config.optim.seed)
    trainer = Trainer(method, config.optim, batches, checkpoint_path=scratch / CHECKPOINT_FILE,
                      log=_tee(JsonlMetrics(scratch / METRICS_FILE), log), device=device, progress=progress)
    trainer.fit()
    method.eval()
    shutil.copyfile(scratch / METRICS_FILE, out / METRICS_FILE)
    save_alignment(method, out / ALIGNMENT_FILE)
    loss_plot(out / METRICS_FILE, out / LOSS_PLOT_FILE)
    anchors = ASIF(train.image[pairing.paired], train.text[pairing.paired],
                   min(config.asif.k, len(pairing.paired)), config.asif.p, config.asif.backend)

    def score(image: Map, text: Map) -> dict[str, dict[str, float]]:
        templates = config.evaluation.templates or spec.captions.templates
        return score_space(image, text, test, templates, config.text.model, config.evaluation.retrieval_k)

    results = {"suites": score(network_map(method.image_net), network_map(method.text_net)),
               "baselines": {"asif": {"suites": score(anchors.embed_a, anchors.embed_b)}},
               "samples": {"paired": len(pairing.paired), "unpaired_image": len(pairing.unpaired_image),
                           "unpaired_text": len(pairing.unpaired_text), "test": len(test.indices)}}
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    return {**summarise(out / METRICS_FILE, trainer.steps_per_epoch), **_scores(results)}


def align_scores(output: StageOutput) -> dict[str, float]:
    """What an align output scores, for a comparison table: its zero-shot and retrieval results, ASIF's
    (``asif_*``) and the sample counts they rest on (``unpaired_image_samples``); not the training's
    bookkeeping (loss, steps, epochs) that its metrics also hold."""
    return _scores(json.loads((output.path / RESULTS_FILE).read_text()))


def _scores(results: dict) -> dict[str, float]:
    """The flat metrics of ``results.json``: each suite's scores (ASIF's prefixed ``asif_``) and each
    sample count as ``<name>_samples``."""
    spaces = {"": results["suites"], "asif_": results["baselines"]["asif"]["suites"]}
    scores = {f"{prefix}{name}": value for prefix, suites in spaces.items() for metrics in suites.values()
              for name, value in metrics.items()}
    return scores | {f"{name}_samples": count for name, count in results["samples"].items()}


def loss_plot(metrics_path: Path, path: Path) -> Path:
    """A PNG of the per-step curves in ``metrics.jsonl`` (loss, contrastive, geo_a, geo_b)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    for name in CURVES:
        points = [(record["step"], record[name]) for record in records if name in record]
        if points:
            axes.plot(*zip(*points), label=name)
    axes.set_xlabel("step")
    axes.set_yscale("log")
    axes.legend()
    axes.set_title("alignment loss")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


ALIGN = StageKind("align", align_stage_of, align, (RESULTS_FILE, LOSS_PLOT_FILE, METRICS_FILE, ALIGNMENT_FILE),
                  streams=True, scores=align_scores, describe=lambda _, m: ", ".join(f"{name} {m[name]:.3f}" for name in
                                                                ("zeroshot_top1", "i2t_r1") if name in m))
