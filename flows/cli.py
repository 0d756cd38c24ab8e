"""The ``repsim`` command line. Flows are imported lazily, inside each command, so ``--help`` and
user mistakes answer at once. A user mistake prints one line, ``error: <what>; <how to fix>``, and
exits 2. Every YAML argument is a path or the name of a shipped file (see :mod:`repsim.shipped`)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from repsim import stopping
from repsim.errors import (DISK_FULL_TEXTS, DiskFull, RepsimError, SpecError, disk_full, disk_full_error, mount_point,
                           require_free_space)
from repsim.stopping import Stopped

EXIT_USER_ERROR = 2
MIN_FREE_BYTES = int(float(os.environ.get("REPSIM_MIN_FREE_MB", "100")) * 2**20)  # refused below: a run's records alone
NEARLY_FULL_BYTES = 2**20  # an error with less free under $REPSIM_HOME is taken for a full disk


def cmd_shard(args: argparse.Namespace) -> None:
    from repsim.data import ShardResult, load_spec
    from repsim.data.remote import check_destination, is_url, upload
    from repsim.data.manifest import MANIFEST

    specs = [load_spec(spec) for spec in args.specs]  # validate every spec before starting any orchestration
    if args.out and len(args.specs) != 1:
        raise RepsimError("--out names one directory but several specs were given", "shard one spec at a time")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise RepsimError(f"--out {args.out} is a file, not a directory", "name a new or existing directory")
    bucket = args.out if args.out and is_url(args.out) else None  # built in $REPSIM_HOME, then uploaded there
    if bucket:
        check_destination(bucket)  # a read-only scheme or a missing bucket, before any work
    rows = []
    for path, spec in zip(args.specs, specs):
        section = {"kind": "shard", "out": None if bucket else args.out}
        [shards] = _run_section(spec.name, path, section, args.cluster)["stages"]
        found = ShardResult.from_dir(shards["path"])
        uploaded = f"{len(upload(found.path, bucket, last=MANIFEST))} files uploaded" if bucket else ""
        rows.append([path, found.num_samples, " ".join(f"{k}={v}" for k, v in found.splits.items()), found.errors,
                     "yes" if shards["cached"] else "no", " ".join(filter(None, [bucket or shards["path"], uploaded]))])
    print(_table(["spec", "samples", "splits", "errors", "cached", "output"], rows))


def _run_section(name: str, data: str | os.PathLike, section: dict, cluster: str | None) -> dict:
    """The outcome of the one-section experiment ``name`` on the data spec ``data``, run by the experiment flow
    (its split stages on ``cluster``)."""
    from repsim.experiment import single_section

    experiment = single_section(name, data, section, cluster)
    _start_orchestration(stop_on_signals=True)  # first: nothing is written before its checks
    from repsim.flows.experiment import experiment_flow_on

    with experiment_flow_on(experiment.cluster) as flow:
        return flow(experiment=experiment)


PRECOMPUTE_STAGES = {  # subcommand: (captions, wordnet, neighbors), what it computes
    "all": ((True, True, True), "caption embeddings, WordNet similarities and caption neighbors"),
    "captions": ((True, False, False), "caption embeddings (N x D, float16, manifest order)"),
    "wordnet": ((False, True, False), "WordNet class similarities (C x C)"),
    "neighbors": ((True, False, True), "caption embeddings and each caption's k nearest others")}


def cmd_precompute(args: argparse.Namespace) -> None:
    from repsim.data import load_spec
    from repsim.similarity.stage import spec_classes

    (captions, wordnet, neighbors), _ = PRECOMPUTE_STAGES[args.stages]
    spec = load_spec(args.spec)  # validate before starting any orchestration
    measures = list(dict.fromkeys(args.measures or ["wup"])) if wordnet else []
    if measures:
        spec_classes(spec)
    section = {"kind": "precompute", "captions": captions, "wordnet": measures, "neighbors": args.k * neighbors,
               "index": args.index, "metric": args.metric, "model": args.model,
               "target_temperature": args.target_temperature}
    _print_stages(_run_section(spec.name, args.spec, section, args.cluster)["stages"])


def cmd_eval(args: argparse.Namespace) -> None:
    from repsim.data import load_spec
    from repsim.eval.stage import (DEFAULT_SUITES, KNN_K, PIXELS, RESULTS_FILE, check_evaluation, encoder_source,
                                        read_results, result_rows)

    spec = load_spec(args.spec)  # validate before starting any orchestration
    suites, knn_k = check_evaluation(args.suites or DEFAULT_SUITES, args.k or KNN_K, labelled=spec.classes is not None)
    if args.encoder.startswith("models:/"):  # a registered encoder: its files, fetched once
        from repsim.tasks.tracking import model_directory

        args.encoder = str(model_directory(args.encoder))
    encoder_source(args.encoder)
    pixels = args.encoder == PIXELS
    section = {"kind": "evaluate", "suites": list(suites), "knn_k": list(knn_k), "pixels": pixels,
               "encoders": {} if pixels else {"encoder": args.encoder}, "batch_size": args.batch_size,
               "device": args.device}
    stages = _run_section(spec.name, args.spec, section, args.cluster)["stages"]
    _print_stages(stages)
    [evaluated] = [stage["path"] for stage in stages if stage["stage"] == "evaluate"]
    rows = result_rows(read_results(evaluated))
    print("\n" + _table(["suite", "metric", "value"], [[suite, name, f"{value:.4g}"] for suite, name, value in rows]))
    print(f"\nresults: {os.path.join(evaluated, RESULTS_FILE)}")


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
    from repsim.layering import as_settings
    from repsim.methods.config import load_config

    config = load_config(args.config, args.overrides)
    # Under torchrun, rank 0 orchestrates and the others train alongside; with --direct (how the train
    # task launches torchrun) every rank trains directly.
    rank = int(os.environ.get("RANK", "0"))
    if args.direct or rank > 0:
        from repsim.methods.stage import train
        from repsim.stage import Reuse

        train(config, progress=args.direct and rank == 0, reuse=Reuse.forcing(["train"] if args.rebuild else []))
        return
    method = {"config": args.config, "settings": as_settings(args.overrides, "optim.lr=0.01")}
    _run_configured(config.data.spec, {"kind": "train", "methods": [method]}, "trained", args.cluster)


def _run_configured(data: str | os.PathLike, section: dict, done: str, cluster: str | None) -> None:
    """Run the one ``section`` of a configured stage on the data spec ``data`` (its split stages on ``cluster``),
    then print its metrics as a table, whether it was ``done`` or found cached, and where."""
    from repsim.data import load_spec
    from repsim.stage import read_record

    stages = _run_section(load_spec(data).name, data, section, cluster)["stages"]  # the spec validated before orchestration
    [summary] = [summary for summary in stages if summary["stage"] == section["kind"]]
    metrics = read_record(Path(summary["path"]))["metrics"]
    print(_table(["metric", "value"], [[name, f"{value:.4g}"] for name, value in sorted(metrics.items())]))
    print(f"{'cached' if summary['cached'] else done}: {summary['path']}")


def cmd_align(args: argparse.Namespace) -> None:
    from repsim.align.config import load_align_config
    from repsim.layering import as_settings

    config = load_align_config(args.config, args.overrides)
    section = {"kind": "align", "config": args.config, "settings": as_settings(args.overrides, "geometry.alpha=0"),
               "as_configured": True}
    _run_configured(config.data.spec, section, "aligned", args.cluster)


def cmd_run(args: argparse.Namespace) -> None:
    from repsim.experiment import check_experiment, load_experiment
    from repsim.results import table
    from repsim.sections import check_stage_names

    experiment = load_experiment(args.experiment, args.overrides)
    check_experiment(experiment)  # validate before orchestration
    check_stage_names(args.force)
    from repsim.tasks.cluster import requested_cluster

    requested_cluster(args.cluster or experiment.cluster)
    if args.spread and not os.environ.get("PREFECT_API_URL"):
        raise SpecError("--spread runs members on the workers of a Prefect server, and none is configured",
                        f"set PREFECT_API_URL ({_start_servers()}) or leave out --spread")
    if args.plan:
        from repsim.flows.experiment import plan_experiment

        _print_plan(plan_experiment(experiment, args.force))
        return
    _start_orchestration(stop_on_signals=True)  # first: nothing is written before its checks
    from repsim.flows.experiment import experiment_flow_on

    with experiment_flow_on(args.cluster or experiment.cluster, args.concurrency) as flow:
        # the file as written and the overrides apart, so that the run records the command that made it
        outcome = flow(experiment=load_experiment(args.experiment), overrides=args.overrides, force=args.force,
                       spread=args.spread)
    _print_stages(outcome["stages"])
    print("\n" + _table(*table(outcome["rows"], outcome["columns"], encoder="method")))
    print(f"\n{_where_to_look()}")


def _print_stages(stages: list[dict]) -> None:
    """One row per stage: stage, detail, members sharing it (when any is shared), cached, output."""
    shared = any(s.get("members", 1) > 1 for s in stages)
    print(_table(["stage", "detail", *(["members"] if shared else []), "cached", "output"], [
        [s["stage"], s["detail"], *([s["members"]] if shared else []), "yes" if s["cached"] else "no", s["path"]]
        for s in stages]))


def _print_plan(plan: dict) -> None:
    stages = plan["stages"]
    print(_table(["stage", "detail", "members", "status", "key"],
                 [[s["stage"], s["detail"], s["members"], s["status"], s["key"] or "-"] for s in stages]))
    cached = sum(s["status"] == "cached" for s in stages)
    members = plan["members"]
    print(f"\n{len(members)} member{'s' * (len(members) != 1)}{': ' + ', '.join(members) if members[0] else ''}")
    print(f"{len(stages)} stages: {cached} cached, {len(stages) - cached} to run")


def _where_to_look() -> str:
    from repsim.stage import repsim_home
    from repsim.tasks.tracking import Tracker, runs_page

    experiment = Tracker().experiment_id
    if os.environ.get("PREFECT_API_URL"):
        return (f"runs: Prefect UI at {os.environ['PREFECT_API_URL'].removesuffix('/api')}, "
                f"MLflow UI at {runs_page(os.environ['MLFLOW_TRACKING_URI'], experiment)}")
    mlflow_ui = f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5000')}"
    return (f"runs: `make ui` serves the MLflow UI ({runs_page(mlflow_ui, experiment)}) and the "
            f"Prefect UI (http://127.0.0.1:4200) over {repsim_home()}; outputs: `repsim stages`")


def cmd_stages(args: argparse.Namespace) -> None:
    from repsim.stage import list_outputs

    outputs = [output for output in list_outputs(hashes=args.verify) if not args.stages or output.stage in args.stages]
    print(_table(["stage", "key", "status", "age", "output"], [
        [output.stage, output.key, output.shown, _age(output.modified), output.path] for output in outputs]))


def cmd_clean(args: argparse.Namespace) -> None:
    from repsim.stage import remove_output, unreferenced_outputs

    doomed = unreferenced_outputs(args.older_than)
    if not args.yes:
        for output in doomed:
            print(f"would remove {output.stage} {output.key} ({output.shown}, {_age(output.modified)}): {output.path}")
        print(f"{len(doomed)} outputs to remove; run again with --yes to remove them")
        return
    removed = [output for output in doomed if remove_output(output)]
    for output in removed:
        print(f"removed {output.stage} {output.key}: {output.path}")
    print(f"removed {len(removed)} outputs" + (f"; {len(doomed) - len(removed)} are in use (being written or read), "
                                               "and stay" if len(removed) < len(doomed) else ""))


def cmd_doctor(args: argparse.Namespace) -> int:
    from repsim.doctor import OK, PROBLEM, Check, checks
    from repsim.tasks.servers import health_urls, server_fix, unreachable

    found = checks()
    for variable, url in health_urls().items():
        reason = unreachable(url)
        found.append(Check(variable, OK, f"{url} answers") if reason is None else
                     Check(variable, PROBLEM, f"{url} does not answer ({reason})", server_fix(variable)))
    print(_table(["check", "status", "found", "fix"], [[c.name, c.status, c.detail, c.fix] for c in found]))
    return int(any(check.status == PROBLEM for check in found))


class _VersionAction(argparse.Action):
    """``--version``: repsim's version with torch's and FAISS's, and the GPUs each sees."""

    def __call__(self, parser, namespace, values, option_string=None):
        from repsim.doctor import version_line

        print(version_line())
        parser.exit()


def cmd_serve(args: argparse.Namespace) -> None:
    from repsim.experiment import check_experiment, load_deployments

    for experiment in load_deployments(args.deployments)[1]:  # validate before orchestration
        check_experiment(experiment)
    if not os.environ.get("PREFECT_API_URL"):
        print("note: no Prefect server is configured, so these deployments live on a temporary API that the "
              "Prefect UI and other processes cannot reach; for schedules and UI runs start servers first "
              f"({_start_servers()})", file=sys.stderr)
    _start_orchestration()
    from repsim.flows.serve import serve_deployments

    serve_deployments(args.deployments)


def _start_servers() -> str:
    """How to start the servers and point this shell at them, with this run's ``$REPSIM_HOME``."""
    from repsim.stage import repsim_home

    return f"make servers; source {shlex.quote(str(repsim_home() / 'servers' / 'env.sh'))}"


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhdw])")


def duration(text: str) -> float:
    """Seconds in ``30m``, ``12h``, ``7d``, ``2w``, ``1.5d``: a positive number and a unit (s, m, h, d, w)."""
    match = DURATION.fullmatch(text)
    if match is None or float(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 12h, 7d or 2w "
                                         "(a positive number, then s, m, h, d or w)")
    return float(match[1]) * DURATION_UNITS[match[2]]


def _age(timestamp: float) -> str:
    import time

    seconds = max(0.0, time.time() - timestamp)
    for unit in ("w", "d", "h", "m"):
        if seconds >= DURATION_UNITS[unit]:
            return f"{seconds / DURATION_UNITS[unit]:.0f}{unit}"
    return f"{seconds:.0f}s"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


HOOK_LINES = re.compile(r"Running hook '[^']*' in response to entering state|Hook '[^']*' finished running successfully")


def _keep_log_record(record: logging.LogRecord) -> bool:
    """Keep Prefect's line for a RepsimError but drop its traceback (the error stays on the record as
    ``repsim_error``); drop the records of a full disk (a store's failed writes), which the CLI explains in
    one line, and Prefect's lines around each state hook (a stage's summary line is the hook's own)."""
    error = record.exc_info[1] if record.exc_info else getattr(record, "repsim_error", None)
    if isinstance(error, RepsimError):
        record.exc_info, record.exc_text, record.repsim_error = None, None, error
        return True
    message = record.getMessage()
    return not (disk_full(error) or any(text in message for text in DISK_FULL_TEXTS) or HOOK_LINES.match(message))


class OneErrorLine(logging.Filter):
    """On the console, after :func:`_keep_log_record`: drop the lines of a RepsimError and Prefect's later
    lines that repeat its message (a failed task's and flow's final states), since the CLI ends with the
    error as its one ``error:`` line. The Prefect UI still receives them."""

    def __init__(self):
        super().__init__()
        self.errors: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        error = getattr(record, "repsim_error", None)
        if isinstance(error, RepsimError):
            self.errors.append(error.args[0] if error.args else str(error))
            return False
        message = record.getMessage()
        return not any(text in message for text in self.errors)


def _filled_a_disk(err: BaseException) -> DiskFull | None:
    """The one-line error for ``err`` if a full disk caused it (ENOSPC, or $REPSIM_HOME's file system is
    nearly full, as when Prefect's temporary API dies on its full SQLite store), naming the file it wrote."""
    from repsim.stage import repsim_home

    if not disk_full(err) and shutil.disk_usage(mount_point(repsim_home())).free >= NEARLY_FULL_BYTES:
        return None
    while err is not None and not (isinstance(err, OSError) and err.filename):
        err = err.__cause__ or err.__context__
    where = Path(err.filename) if err is not None else repsim_home()
    what = f"writing {where} failed" if err is not None else f"the run records under {where} could not be written"
    return disk_full_error(where, what, max(MIN_FREE_BYTES, NEARLY_FULL_BYTES))


def _start_orchestration(stop_on_signals: bool = False) -> None:
    """Before a flow starts: check the configured servers and free space, start the embedded stores, drop
    RepsimError tracebacks from the logs; with ``stop_on_signals``, SIGTERM and SIGINT stop the run."""
    from repsim.stage import repsim_home
    from repsim.tasks.servers import check_servers
    from repsim.tasks.settings import start_embedded_stores

    check_servers()
    require_free_space(repsim_home(), MIN_FREE_BYTES, "a run (its stage outputs and run records)")
    start_embedded_stores()
    from prefect.logging.configuration import setup_logging

    setup_logging()
    one_error_line = OneErrorLine()
    for handler in logging.getLogger().handlers + logging.getLogger("mlflow").handlers:
        handler.addFilter(_keep_log_record)
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.addFilter(one_error_line)
    if stop_on_signals:
        stopping.install()


def add_overrides(parser: argparse.ArgumentParser, what: str, example: str) -> None:
    """The repeatable ``--set KEY=VALUE`` option, overriding a field of ``what``."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override {what} field, e.g. --set {example} (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="repsim", description="Learn visual representations from relations between samples.")
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="print repsim's, torch's and FAISS's versions and GPUs")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, run: Callable[[argparse.Namespace], int | None], **options: str) -> argparse.ArgumentParser:
        subparser = commands.add_parser(name, **options)
        subparser.set_defaults(run=run)
        return subparser

    shard = command("shard", cmd_shard, help="shard data specs into WebDataset tars + manifest (cached)")
    shard.add_argument("specs", nargs="+", metavar="SPEC",
                       help="data spec YAML file(s) or shipped name(s), e.g. animal-mnist")
    shard.add_argument("--out", metavar="DIR", help="output directory (default: $REPSIM_HOME/artifacts/shard/<key>), "
                       "or a folder URL (s3://bucket/prefix/) to upload the output to, its manifest last")
    precompute = commands.add_parser(
        "precompute", help="shard a data spec, then embed captions, WordNet similarities, neighbors (cached)")
    stages = precompute.add_subparsers(dest="stages", metavar="STAGES", required=True)
    for name, (_, what) in PRECOMPUTE_STAGES.items():
        _add_precompute_options(stages.add_parser(name, help=what, description=f"Shard SPEC, then compute {what}."), name)
    evaluate = command(
        "eval", cmd_eval, help="evaluate an encoder on a data spec: kNN, linear probe, diagnostics, plots (cached)")
    evaluate.add_argument("spec", metavar="SPEC", help="data spec YAML file or shipped name, e.g. animal-mnist")
    evaluate.add_argument("--encoder", default="pixels", metavar="pixels|PATH|models:/NAME/VERSION",
                          help="'pixels' (raw-pixel baseline, default), a train stage directory or its encoder.pt, "
                          "or a registered encoder, e.g. models:/animal-mnist-xclr/1")
    evaluate.add_argument("--suite", dest="suites", action="append",
                          choices=("knn", "linear", "map", "diagnostics", "plots"),
                          help="evaluation suite, repeatable (default: knn, linear, diagnostics, plots)")
    evaluate.add_argument("--k", type=int, action="append", help="kNN neighbors, repeatable (default: 10, 20, 200)")
    evaluate.add_argument("--batch-size", type=int, default=512, help="feature extraction batch size (default: 512)")
    evaluate.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda when present)")
    train = command("train", cmd_train, help="train an experiment config (cached; resumes if interrupted)")
    train.add_argument("config", metavar="CONFIG", help="experiment config YAML or shipped name, e.g. xclr")
    add_overrides(train, "a config", "optim.lr=0.1")
    train.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    train.add_argument("--rebuild", action="store_true", help=argparse.SUPPRESS)  # a rank's: the output is stale
    align = command("align", cmd_align, help="align frozen image and text embeddings from few pairs: GeRA, "
                    "contrastive alone (alpha=0) and ASIF, scored zero-shot and by retrieval (cached)")
    align.add_argument("config", metavar="CONFIG", help="alignment config YAML or shipped name, e.g. gera")
    add_overrides(align, "a config", "geometry.alpha=0")
    run = command("run", cmd_run, help="run an experiment end to end: shard, precompute, train, evaluate, align "
                  "(every stage cached)")
    run.add_argument("experiment", metavar="EXPERIMENT", help="experiment YAML or shipped name, e.g. default")
    add_overrides(run, "an experiment", "train.settings.optim.lr=0.01")
    run.add_argument("--force", action="append", default=[], metavar="STAGE",
                     help="rebuild this stage's outputs even if cached, repeatable (shard, captions, wordnet, "
                          "neighbors, train, features, evaluate, align, or a stage a package adds)")
    run.add_argument("--plan", action="store_true",
                     help="print the stages (each member's, shared ones once), which are cached, and their count; run nothing")
    run.add_argument("--concurrency", type=_positive_int, metavar="N",
                     help="stages run at once (default: $REPSIM_CONCURRENCY, else one per GPU, else 1)")
    run.add_argument("--spread", metavar="DEPLOYMENT",
                     help="run each member as a flow run of this deployment of the experiment flow "
                          "(e.g. experiment/sweep-worker), on whichever processes serve it; needs a Prefect server")
    stages = command("stages", cmd_stages, help="list stage outputs: key, status (complete/damaged/incomplete/"
                     "locked/in use), path")
    stages.add_argument("stages", nargs="*", metavar="STAGE", help="only these stages (default: all)")
    stages.add_argument("--verify", action="store_true",
                        help="also compare every output file's sha256 with its record (default: sizes only)")
    clean = command("clean", cmd_clean, help="remove old stage outputs that no newer complete output depends on")
    clean.add_argument("--older-than", required=True, type=duration, metavar="DURATION",
                       help="only outputs completed (or, if incomplete, last written) longer ago: 30m, 12h, 7d, 2w")
    clean.add_argument("--yes", action="store_true", help="remove them (default: only list what would go)")
    serve = command("serve", cmd_serve, help="serve deployments of the experiment flow (cron schedules, UI runs)")
    serve.add_argument("deployments", nargs="?", default="deployments", metavar="DEPLOYMENTS",
                       help="deployments YAML or shipped name (default: deployments, the shipped "
                       "experiments/deployments.yaml)")
    for splitting in (shard, evaluate, train, align, run):
        add_cluster(splitting)
    synsets = command("synsets", cmd_synsets, help="list WordNet noun synsets for class names (to write specs)")
    synsets.add_argument("names", nargs="+", metavar="NAME", help='a class name, e.g. "Ankle boot"')
    command("doctor", cmd_doctor, help="what this installation has: torch and its GPUs, which FAISS build, "
            "offline data and model, where runs are tracked (exit 1 on a problem)")
    return parser


def add_cluster(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="tcp://HOST:PORT|local:N",
                        help="run the split stages' pieces on a Dask cluster: a running scheduler, or N worker "
                             "processes started here (default: $DASK_SCHEDULER_ADDRESS, else none)")


def _add_precompute_options(parser: argparse.ArgumentParser, stages: str) -> None:
    from repsim.similarity.neighbors import METRICS, STAGE_INDEXES

    (captions, wordnet, neighbors), _ = PRECOMPUTE_STAGES[stages]
    parser.add_argument("spec", metavar="SPEC", help="data spec YAML file or shipped name, e.g. animal-mnist")
    add_cluster(parser)
    parser.set_defaults(run=cmd_precompute, measures=None, k=10, index="auto", metric="cosine", model=None)
    if captions:
        parser.add_argument("--model", metavar="NAME|PATH",
                            help="sentence-transformers model (default: all-MiniLM-L6-v2, offline)")
    if wordnet:
        parser.add_argument("--measure", dest="measures", action="append", choices=("wup", "path", "lch", "hops"),
                            help="WordNet measure, repeatable (default: wup)")
    if neighbors:
        parser.add_argument("--k", type=int, default=10, help="neighbors per caption (default: 10)")
        parser.add_argument("--index", choices=STAGE_INDEXES, default="auto",
                            help="FAISS index: exact flat, approximate ivf/ivfpq/hnsw with measured recall, or "
                            "auto (flat up to 50,000 captions, then hnsw, or ivfpq where hnsw would not fit)")
        parser.add_argument("--metric", choices=METRICS, default="cosine", help="default: cosine")
    parser.add_argument("--target-temperature", type=float, default=0.1, metavar="TAU_S",
                        help="X-CLR target temperature of the target histograms logged to MLflow (default: 0.1)")


def main(argv: Sequence[str] | None = None) -> int:
    from repsim.layering import read_once
    from repsim.tasks.settings import use_embedded_defaults

    use_embedded_defaults()  # before any command imports Prefect or MLflow, which read their settings then
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int | None] = args.run
    try:
        with read_once():  # each settings file is read once, however many layers ask for it
            return run(args) or 0
    except Stopped as err:
        stopping.exit_now(err.signum, str(err))
    except Exception as err:
        user_error = err if isinstance(err, RepsimError) else _filled_a_disk(err)
        if user_error is None:
            raise
        print(f"error: {user_error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
