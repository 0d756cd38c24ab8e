"""The ``repsim`` command line. Flows are imported lazily, inside each command, so ``--help`` and
user mistakes answer at once. A user mistake prints one line, ``error: <what>; <how to fix>``, and
exits 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from repsim.errors import RepsimError

EXIT_USER_ERROR = 2


def cmd_shard(args: argparse.Namespace) -> None:
    from repsim.data import load_spec

    for spec in args.specs:  # validate every spec before starting any orchestration
        load_spec(spec)
    if args.out and len(args.specs) != 1:
        raise RepsimError("--out names one directory but several specs were given", "shard one spec at a time")
    from repsim.flows.shard import shard_flow

    _quiet_user_errors()
    summaries = shard_flow(specs=list(args.specs), out_dir=args.out)
    print(_table(["spec", "samples", "splits", "errors", "cached", "output"], [
        [s["spec"], sum(s["splits"].values()), " ".join(f"{k}={v}" for k, v in s["splits"].items()),
         s["errors"], "yes" if s["cached"] else "no", s["path"]] for s in summaries]))


def cmd_precompute(args: argparse.Namespace) -> None:
    from repsim.data import load_spec
    from repsim.similarity.stages import spec_classes

    spec = load_spec(args.spec)  # validate before starting any orchestration
    measures = [] if args.no_wordnet else list(dict.fromkeys(args.measures or ["wup"]))
    if measures:
        spec_classes(spec)
    from repsim.flows.precompute import precompute_flow

    _quiet_user_errors()
    summaries = precompute_flow(spec=args.spec, captions=not args.no_captions, wordnet_measures=measures,
                                neighbours=not (args.no_captions or args.no_neighbours), k=args.k, kind=args.index)
    print(_table(["stage", "detail", "cached", "output"], [
        [s["stage"], s["detail"], "yes" if s["cached"] else "no", s["path"]] for s in summaries]))


def cmd_eval(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from repsim.data import load_spec
    from repsim.eval.stages import DEFAULT_SUITES, KNN_K, check_evaluation, encoder_source, result_rows

    spec = load_spec(args.spec)  # validate before starting any orchestration
    suites, knn_k = check_evaluation(args.suites or DEFAULT_SUITES, args.k or KNN_K, labelled=spec.classes is not None)
    encoder_source(args.encoder)
    from repsim.flows.evaluate import evaluate_flow

    _quiet_user_errors()
    outcome = evaluate_flow(spec=args.spec, encoder=args.encoder, suites=list(suites), knn_k=list(knn_k),
                            batch_size=args.batch_size, device=args.device)
    print(_table(["stage", "detail", "cached", "output"], [
        [s["stage"], s["detail"], "yes" if s["cached"] else "no", s["path"]] for s in outcome["stages"]]))
    rows = result_rows(json.loads(Path(outcome["results"]).read_text()))
    print()
    print(_table(["suite", "metric", "value"], [[suite, name, f"{value:.4g}"] for suite, name, value in rows]))
    print(f"\nresults: {outcome['results']}")


def cmd_synsets(args: argparse.Namespace) -> None:
    from repsim.errors import SimilarityError
    from repsim.similarity.wordnet import synsets_for

    for name in args.names:
        candidates = synsets_for(name)
        if not candidates:
            raise SimilarityError(f"WordNet has no noun for {name!r}", "try a synonym or a more general word")
        print(f"{name}:")
        for synset, gloss in candidates:
            print(f"  {synset:<28} {gloss}")


def cmd_train(args: argparse.Namespace) -> None:
    from repsim.data import load_spec
    from repsim.methods.config import load_config

    config = load_config(args.config, args.overrides)
    load_spec(config.data.spec)  # validate before orchestration
    if int(os.environ.get("RANK", "0")) > 0:  # under torchrun, rank 0 orchestrates; the others train alongside
        from repsim.methods.stage import train

        train(config, progress=False)
        return
    from repsim.flows.train import train_flow

    _quiet_user_errors()
    summary = train_flow(config=args.config, overrides=args.overrides)
    rows = [[name, f"{value:.4g}"] for name, value in sorted(summary["metrics"].items())]
    print(_table(["metric", "value"], rows))
    print(f"{'cached' if summary['cached'] else 'trained'}: {summary['path']}")


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


class _NoTracebackForUserErrors(logging.Filter):
    """Keep Prefect's console line for a RepsimError but drop its traceback: the CLI explains it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RepsimError):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_user_errors() -> None:
    from prefect.logging.configuration import setup_logging

    setup_logging()
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NoTracebackForUserErrors())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="repsim", description="Learn visual representations from relations between samples.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    shard = commands.add_parser("shard", help="shard data specs into WebDataset tars + manifest (cached)")
    shard.add_argument("specs", nargs="+", metavar="SPEC", help="data spec YAML file(s)")
    shard.add_argument("--out", metavar="DIR", help="output directory (default: $REPSIM_HOME/artifacts/shard/<key>)")
    shard.set_defaults(run=cmd_shard)
    precompute = commands.add_parser(
        "precompute", help="shard a data spec, then embed captions, WordNet similarities, neighbours (cached)")
    precompute.add_argument("spec", metavar="SPEC", help="data spec YAML file")
    precompute.add_argument("--measure", dest="measures", action="append", choices=("wup", "path", "lch", "hops"),
                            help="WordNet measure, repeatable (default: wup)")
    precompute.add_argument("--no-wordnet", action="store_true", help="skip the WordNet class similarity")
    precompute.add_argument("--no-captions", action="store_true",
                            help="skip the caption embeddings (and the neighbours found among them)")
    precompute.add_argument("--no-neighbours", action="store_true", help="skip the caption neighbour lists")
    precompute.add_argument("--k", type=int, default=10, help="neighbours per caption (default: 10)")
    precompute.add_argument("--index", choices=("flat", "ivf", "hnsw"), default="flat",
                            help="FAISS index: exact flat, or approximate ivf/hnsw with measured recall")
    precompute.set_defaults(run=cmd_precompute)
    evaluate = commands.add_parser(
        "eval", help="evaluate an encoder on a data spec: kNN, linear probe, diagnostics, plots (cached)")
    evaluate.add_argument("spec", metavar="SPEC", help="data spec YAML file")
    evaluate.add_argument("--encoder", default="pixels", metavar="pixels|PATH",
                          help="'pixels' (raw-pixel baseline, default), a train stage directory or its encoder.pt")
    evaluate.add_argument("--suite", dest="suites", action="append",
                          choices=("knn", "linear", "map", "diagnostics", "plots"),
                          help="evaluation suite, repeatable (default: knn, linear, diagnostics, plots)")
    evaluate.add_argument("--k", type=int, action="append", help="kNN neighbours, repeatable (default: 10, 20, 200)")
    evaluate.add_argument("--batch-size", type=int, default=512, help="feature extraction batch size (default: 512)")
    evaluate.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda when present)")
    evaluate.set_defaults(run=cmd_eval)
    train = commands.add_parser("train", help="train an experiment config (cached; resumes if interrupted)")
    train.add_argument("config", metavar="CONFIG", help="experiment config YAML, e.g. configs/xclr.yaml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set optim.lr=0.1 (repeatable)")
    train.set_defaults(run=cmd_train)
    synsets = commands.add_parser("synsets", help="list WordNet noun synsets for class names (to write specs)")
    synsets.add_argument("names", nargs="+", metavar="NAME", help='a class name, e.g. "Ankle boot"')
    synsets.set_defaults(run=cmd_synsets)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], None] = args.run
    try:
        run(args)
    except RepsimError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
