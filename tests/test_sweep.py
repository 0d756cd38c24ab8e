"""Seeds and sweeps: expansion into members, the result table's aggregation, the plan, and a swept
experiment run end to end with shared stages built once and two stages at a time."""

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from e2e import REPO, flow_runs, prefect_query, repsim, tiny_experiment

from repsim.errors import SpecError
from repsim.experiment import check_experiment, expand, load_experiment
from repsim.sections import SECTIONS
from repsim.results import Score, aggregate, as_records, cell, markdown
from repsim.stage import read_record

SWEEP = ["seeds=[0, 1]", "sweep={train.settings.optim.lr: [0.001, 0.002]}"]


def test_seeds_times_grid_points_are_members_with_their_overrides():
    experiment = load_experiment("default", SWEEP)
    members = expand(experiment)
    assert [member.label for member in members] == ["lr=0.001 seed=0", "lr=0.001 seed=1",
                                                    "lr=0.002 seed=0", "lr=0.002 seed=1"]
    for member, (lr, seed) in zip(members, [(0.001, 0), (0.001, 1), (0.002, 0), (0.002, 1)]):
        train, align = member.experiment.section("train"), member.experiment.section("align")
        assert train.settings["optim"]["lr"] == lr and train.settings["optim"]["seed"] == seed
        assert [align.settings[part]["seed"] for part in ("optim", "pairing", "text")] == [seed] * 3
        assert member.experiment.seeds == [] and member.experiment.sweep == {}
        # everything the sweep and the seed do not set is the experiment's own
        assert train.settings["optim"]["epochs"] == experiment.section("train").settings["optim"]["epochs"]
    assert {model.model_fields["kind"].default for model in SECTIONS.models() if model.seed_keys} == {"train", "align"}


def test_a_stage_is_labelled_by_the_grid_values_that_can_change_it():
    experiment = load_experiment("default", ["seeds=[3]", "sweep={align.settings.pairing.pairs: [20], "
                                             "train.methods.xclr.settings.optim.lr: [0.1], train.settings.optim.epochs: [2]}"])
    [member] = expand(experiment)
    assert member.label == "pairs=20 lr=0.1 epochs=2 seed=3"
    assert member.label_through("train", "simclr") == "epochs=2 seed=3"  # neither align's M nor xclr's lr
    assert member.label_through("train", "xclr") == "lr=0.1 epochs=2 seed=3"
    assert member.label_through("align", "simclr") == "pairs=20 epochs=2 seed=3"
    assert member.label_through("align", "pixels") == "pairs=20 seed=3"  # no trained encoder


def test_a_grid_point_of_a_dict_value_names_its_stage_task_literally():
    from flows.experiment import task_run_name

    experiment = load_experiment("default", ["seeds=[0]", "sweep={train.settings.data.preset_options: "
                                             "[{local_crops: 0, global_scale: [0.5, 1.0]}]}"])
    [member] = expand(experiment)
    assert member.label == "preset_options={global_scale: [0.5, 1.0], local_crops: 0} seed=0"
    template = task_run_name("train", f"simclr [{member.label}]")
    assert template.format(params={}, options={}) == f"train simclr [{member.label}]"  # as Prefect formats it
    assert task_run_name("shard", None) == "shard"


def test_an_experiment_without_seeds_or_sweep_is_its_only_member():
    experiment = load_experiment("default")
    [member] = expand(experiment)
    assert member.label == "" and member.experiment == experiment


@pytest.mark.parametrize("overrides, expected", [
    (["sweep={train.settings.optim.lrr: [0.1]}"], "sweep member lrr=0.1: override 'optim.lrr=0.1': unknown field"),
    (["sweep={trainn.settings.optim.lr: [0.1]}"], "the experiment has no field or section 'trainn'"),
    (["sweep={train.settings.optim.lr: []}"], "sweep"),
    (["sweep={train.settings.optim.lr: [0.1, 0.1]}"], "repeat; list each value once"),
    (["seeds=[1, 1]"], "seeds [1, 1] repeat"),
    (["sweep={seeds: [[0], [1]]}"], "sweeps the sweep"),
    (["seeds=[0, 1]", "train.methods.xclr.seeds=[2]"], "method xclr runs at seeds [2], not all among the experiment's"),
    (["train.methods.xclr.seeds=[0]"], "not all among the experiment's seeds []"),
    (["seeds=[0, 1]", "train.methods.xclr.seeds=[0]", "train.methods.simclr.seeds=[0]"], "no method runs at seed 1"),
    (["train.methods.xclr.seeds=[]", "train.methods.simclr.seeds=[]"], "so none runs; unset one's seeds"),
])
def test_a_bad_sweep_is_refused_in_one_line(overrides, expected):
    with pytest.raises(SpecError) as refused:
        check_experiment(load_experiment("default", overrides))
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_cli_refuses_an_unknown_sweep_key_with_exit_2(tmp_path):
    done = repsim(tmp_path, "run", "default", "--plan", "--set", "sweep={train.settings.optim.lrr: [0.1]}")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "lrr" in done.stderr


def test_aggregate_is_mean_and_sample_std_over_distinct_outputs():
    scores = [Score("lr=0.1", "simclr", "a", {"knn": 0.50, "linear": 0.60}),
              Score("lr=0.1", "simclr", "b", {"knn": 0.54, "linear": 0.70}),
              Score("lr=0.1", "simclr", "c", {"knn": 0.58}),
              Score("lr=0.1", "pixels", "p", {"knn": 0.40}),
              Score("lr=0.1", "pixels", "p", {"knn": 0.40}),  # one output shared by two seeds counts once
              Score("lr=0.2", "simclr", "d", {"knn": 0.30})]
    rows = aggregate(scores)
    assert [(row.point, row.encoder) for row in rows] == [("lr=0.1", "simclr"), ("lr=0.1", "pixels"),
                                                          ("lr=0.2", "simclr")]
    simclr = rows[0]
    assert simclr.mean["knn"] == pytest.approx((0.50 + 0.54 + 0.58) / 3)
    assert simclr.std["knn"] == pytest.approx(((0.04 ** 2 + 0 + 0.04 ** 2) / 2) ** 0.5)
    assert simclr.std["linear"] == pytest.approx(statistics.stdev([0.6, 0.7])) and simclr.n == {"knn": 3, "linear": 2}
    assert rows[1].n == {"knn": 1} and rows[1].std == {"knn": 0.0}
    assert cell(simclr, "knn") == "0.5400 ± 0.0400 (3)" and cell(rows[1], "knn") == "0.4000"
    assert cell(rows[2], "linear") == "-"
    table = markdown(rows, {"kNN": "knn"}).splitlines()  # beside a row of 3, a row of one says so
    assert table[0] == "| grid point | encoder | kNN |" and table[3] == "| lr=0.1 | pixels | 0.4000 (1) |"
    assert markdown(rows[1:2], {"kNN": "knn"}).splitlines()[2] == "| lr=0.1 | pixels | 0.4000 |"  # one seed alone


def test_the_logged_table_has_no_dotted_columns_and_leads_with_the_headline_metrics():
    rows = aggregate([Score("", "simclr", "a", {"linear_val_top1_wd0.01": 0.5, "epochs": 3.0, "knn_top1_k20": 0.6}),
                      Score("", "simclr", "b", {"linear_val_top1_wd0.01": 0.7, "knn_top1_k20": 0.8}),
                      Score("", "pixels", "p", {"knn_top1_k20": 0.4})])
    records = as_records(rows, ["knn_top1_k20", "zeroshot_top1"])  # a headline metric no row has is left out
    assert list(records[0])[:4] == ["encoder", "knn_top1_k20", "knn_top1_k20 std", "knn_top1_k20 n"]  # no sweep
    assert not any("." in name for record in records for name in record)
    assert records[0]["linear_val_top1_wd0_01"] == pytest.approx(0.6) and records[0]["linear_val_top1_wd0_01 n"] == 2
    assert records[1]["epochs"] is None and list(records[1]) == list(records[0])
    assert records[1]["knn_top1_k20 std"] is None and records[1]["knn_top1_k20 n"] == 1  # one value has no spread
    assert "epochs std" not in records[0]  # no row has two values of it


def test_a_table_of_single_values_has_their_means_alone_and_a_swept_one_names_its_points():
    rows = aggregate([Score("", "simclr", "a", {"knn_top1_k20": 0.6, "linear_top1": 0.7}),
                      Score("", "pixels", "p", {"knn_top1_k20": 0.4})])
    assert as_records(rows) == [{"encoder": "simclr", "knn_top1_k20": 0.6, "linear_top1": 0.7},
                                {"encoder": "pixels", "knn_top1_k20": 0.4, "linear_top1": None}]
    swept = aggregate([Score("lr=0.1", "simclr", "a", {"knn_top1_k20": 0.6})])
    assert as_records(swept) == [{"encoder": "simclr", "point": "lr=0.1", "knn_top1_k20": 0.6}]


@pytest.fixture
def swept(make_image_folder, write_spec, tmp_path):
    """The tiny experiment with two seeds and two learning rates, and where its runs live."""
    path = tiny_experiment(tmp_path, make_image_folder, write_spec)
    experiment = yaml.safe_load(path.read_text())
    experiment |= {"seeds": [0, 1], "sweep": {"train.settings.optim.lr": [0.001, 0.002]}}
    path.write_text(yaml.safe_dump(experiment))
    return str(path), tmp_path / "home"


def plan_counts(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def stage_counts(stdout: str) -> dict[str, int]:
    rows = [line.split()[0] for line in stdout.split("\n\n")[0].splitlines()[2:]]
    return {stage: rows.count(stage) for stage in dict.fromkeys(rows)}


@pytest.mark.slow
@pytest.mark.orchestration
def test_sweep_shares_upstream_stages_runs_two_at_a_time_and_reruns_from_cache(swept):
    experiment, home = swept
    planned = repsim(home, "run", experiment, "--plan")
    assert planned.returncode == 0, planned.stderr
    # shard, wordnet; 4 trains; features: pixels 2 + 4 encoders x 2; evaluate: pixels + 4
    assert plan_counts(planned.stdout) == "21 stages: 0 cached, 21 to run"

    first = repsim(home, "run", experiment, "--concurrency", "2")
    assert first.returncode == 0, first.stderr
    assert stage_counts(first.stdout) == {"shard": 1, "wordnet": 1, "train": 4, "features": 10, "evaluate": 5}
    assert len([path for path in (home / "artifacts" / "shard").iterdir() if path.is_dir()]) == 1
    assert len([path for path in (home / "artifacts" / "train").iterdir() if path.is_dir()]) == 4
    table = first.stdout.split("\n\n")[1].splitlines()
    assert table[0].split() == ["grid", "point", "method", "kNN@3"]
    assert [row.split()[:2] for row in table[2:]] == [["lr=0.001", "pixels"], ["lr=0.001", "supcon"],
                                                      ["lr=0.002", "pixels"], ["lr=0.002", "supcon"]]
    assert all(row.endswith("(2)") for row in table[2:] if "supcon" in row)  # mean ± std over 2 seeds
    spans = sorted((record["started"], record["started"] + record["seconds"])
                   for record in (read_record(path) for path in (home / "artifacts" / "train").iterdir() if path.is_dir()))
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))  # two trained at once

    assert plan_counts(repsim(home, "run", experiment, "--plan").stdout) == "21 stages: 21 cached, 0 to run"
    again = repsim(home, "run", experiment)
    assert again.returncode == 0, again.stderr
    assert {line.split()[-2] for line in again.stdout.split("\n\n")[0].splitlines()[2:]} == {"yes"}
    assert again.stdout.split("\n\n")[1] == first.stdout.split("\n\n")[1]

    [(parent, stages), _] = flow_runs(home, "experiment")
    assert parent.info.status == "FINISHED" and len(stages) == 21
    assert sum(run.data.tags["repsim.stage"] == "train" for run in stages) == 4
    names = [run.data.tags["mlflow.runName"] for run in stages]  # named for what they are
    assert {name for name in names if name.startswith("train")} == {
        f"train supcon [lr={lr} seed={seed}]" for lr in (0.001, 0.002) for seed in (0, 1)}
    assert {"features pixels test", "evaluate pixels", "evaluate supcon [lr=0.002 seed=1]"} <= set(names)
    assert {run.data.tags.get("repsim.encoder") for run in stages} == {None, "pixels", "supcon"}  # not the run names
    logged = _mlflow_table(home, parent.info.run_id)
    supcon = [index for index, encoder in enumerate(logged["encoder"]) if encoder == "supcon"]
    knn = {row.split()[0]: float(row.split()[2]) for row in table[2:] if "supcon" in row}
    assert [round(logged["knn_top1_k3"][index], 4) for index in supcon] == [knn["lr=0.001"], knn["lr=0.002"]]
    assert [logged["knn_top1_k3 n"][index] for index in supcon] == [2, 2]
    assert parent.data.metrics["point0.supcon.knn_top1_k3"] == pytest.approx(logged["knn_top1_k3"][supcon[0]])
    assert parent.data.params["point1"] == "lr=0.002"

    markdown_artifacts = _prefect_artifacts(home)
    assert len(markdown_artifacts) == 2 and all("| lr=0.002 | supcon |" in text for text in markdown_artifacts)


def _mlflow_table(home, run_id: str) -> dict:
    """The parent run's result table, read back through the MLflow client: {column: values}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    assert json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "results.json", "type": "table"}]  # what the MLflow UI's table view lists
    table = json.loads(open(client.download_artifacts(run_id, "results.json", str(home))).read())
    return {column: [row[index] for row in table["data"]] for index, column in enumerate(table["columns"])}


def _prefect_artifacts(home) -> list[str]:
    """The markdown of every ``results`` artifact in the Prefect store under ``home``."""
    return prefect_query(home, """
found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=['tiny-results'])))
print(json.dumps([artifact.data for artifact in found]))""")


def test_a_sweep_over_one_methods_settings_leaves_the_others_shared():
    experiment = load_experiment("default", ["sweep={train.methods.xclr.settings.method.target_temperature: [0.05, 0.2]}"])
    members = check_experiment(experiment)
    runs = [member.experiment.section("train").methods for member in members]
    assert [member.label for member in members] == ["target_temperature=0.05", "target_temperature=0.2"]
    assert [methods[1].settings["method"]["target_temperature"] for methods in runs] == [0.05, 0.2]
    assert runs[0][1].settings["method"]["similarity"] == {"type": "wordnet", "measure": "wup"}  # kept
    assert runs[0][0] == runs[1][0]  # simclr: the same call in both members, so one training
    with pytest.raises(SpecError, match="no method labelled 'xclrr'; use one of simclr, xclr"):
        load_experiment("default", ["train.methods.xclrr.settings.optim.lr=0.1"])


def test_a_method_with_its_own_seeds_trains_at_only_those_and_leaves_the_other_stages_alone():
    from repsim.flows.experiment import plan_experiment

    def keys(overrides: list[str]) -> dict[str, str]:
        return {f"{stage['stage']} {stage['detail']}": stage["key"]
                for stage in plan_experiment(load_experiment("default", overrides))["stages"]}

    every, some = keys(["seeds=[0, 1]"]), keys(["seeds=[0, 1]", "train.methods.xclr.seeds=[1]"])
    assert "train xclr [seed=1]" in some and "train xclr [seed=0]" not in some
    assert some == {stage: key for stage, key in every.items() if "xclr [seed=0]" not in stage}
    [at_0, at_1] = expand(load_experiment("default", ["seeds=[0, 1]", "train.methods.xclr.seeds=[1]"]))
    assert [run.label for run in at_0.experiment.section("train").methods] == ["simclr"]
    assert [run.label for run in at_1.experiment.section("train").methods] == ["simclr", "xclr"]
    assert all(run.label == "simclr" for member in expand(load_experiment(
        "default", ["seeds=[0, 1]", "train.methods.xclr.seeds=[]"])) for run in member.experiment.section("train").methods)


@pytest.mark.parametrize("name, members, seeds", [("reproduce-xclr", 6, 3), ("reproduce-xclr-full", 12, 3),
                                                  ("reproduce-gera", 40, 5), ("reproduce-gera-full", 50, 5), ("tune-gera", 64, 2),
                                                  ("reproduce-sop", 3, 3), ("reproduce-sop-full", 3, 3),
                                                  ("reproduce-sop-long", 1, 1), ("reproduce-sop-resnet", 3, 3),
                                                  ("reproduce-sop-options", 2, 2), ("reproduce-sop-8000", 1, 1)])
def test_shipped_reproductions_are_valid_sweeps(name, members, seeds):
    experiment = load_experiment(name)
    assert len(check_experiment(experiment)) == members and experiment.seeds == list(range(seeds))


@pytest.mark.parametrize("name", ["reproduce-xclr", "reproduce-xclr-full"])
def test_every_contrastive_method_of_a_reproduction_trains_at_one_temperature(name):
    from repsim.methods.config import load_config

    experiment = load_experiment(name)
    train = experiment.section("train")
    configs = {run.label: load_config(run.config, train.overrides(run, experiment.data)) for run in train.methods}
    assert {"simclr", "supcon", "xclr-wordnet"} <= set(configs)
    assert {label: config.method.temperature for label, config in configs.items()
            if config.method.name != "clip"} == dict.fromkeys(set(configs) - {"clip"}, 0.1)


def test_default_experiment_trains_what_the_contrastive_reproduction_trains_for_seed_0():
    from repsim.flows.experiment import plan_experiment

    def train_keys(name: str) -> dict[str, str]:
        return {stage["detail"]: stage["key"] for stage in plan_experiment(load_experiment(name))["stages"]
                if stage["stage"] == "train"}

    default, reproduction = train_keys("default"), train_keys("reproduce-xclr")
    assert default == {"simclr": reproduction["simclr [seed=0]"],
                       "xclr": reproduction["xclr-wordnet [target_temperature=0.1 seed=0]"]}


@pytest.mark.parametrize("name", ["reproduce-gera", "reproduce-gera-full"])
def test_gera_reproductions_align_raw_pixels_as_the_floor_under_the_same_settings(name):
    from repsim.flows.experiment import plan_experiment

    experiment = load_experiment(name)
    members = len(check_experiment(experiment))
    aligns = [stage for stage in plan_experiment(experiment)["stages"] if stage["stage"] == "align"]
    assert sum(stage["detail"].startswith("pixels [") for stage in aligns) == members  # one per M, α and seed
    assert len(aligns) == 2 * members  # and the SimCLR encoder's
    section = experiment.section("align")
    encoder, pixels, own = (section.overrides(side, experiment.data) for side in ("/stages/train/key", "pixels", "config"))
    assert [o for o in encoder if "image" not in o] == [o for o in pixels if "image" not in o] == own
    assert {"image": {"type": "pixels"}} in pixels and {"image": {"type": "encoder", "path": "/stages/train/key"}} in encoder


def test_gera_reproduction_runs_the_alpha_chosen_on_validation():
    from repsim.align.config import load_align_config

    alphas = load_experiment("reproduce-gera").sweep["align.settings.geometry.alpha"]
    assert alphas == [0.0, load_align_config("gera").geometry.alpha]


def test_plan_counts_each_shared_stage_once_with_the_members_that_need_it():
    from repsim.flows.experiment import plan_experiment

    experiment = load_experiment("default", ["seeds=[0, 1]",
                                             "sweep={train.methods.xclr.settings.method.target_temperature: [0.05, 0.2]}"])
    stages = plan_experiment(experiment)["stages"]
    trains = {stage["detail"]: stage["members"] for stage in stages if stage["stage"] == "train"}
    assert trains == {"simclr [seed=0]": 2, "xclr [target_temperature=0.05 seed=0]": 1,  # named by what they share
                      "simclr [seed=1]": 2, "xclr [target_temperature=0.05 seed=1]": 1,
                      "xclr [target_temperature=0.2 seed=0]": 1, "xclr [target_temperature=0.2 seed=1]": 1}
    assert [(stage["stage"], stage["members"]) for stage in stages[:4]] == [
        ("shard", 4), ("captions", 4), ("wordnet", 4), ("neighbors", 4)]
    # 4 upstream, 6 trains, features of pixels and 6 encoders x 2 splits, 7 evaluations, 6 alignments
    assert len(stages) == 4 + 6 + 14 + 7 + 6
    assert {stage["status"] for stage in stages[4:]} == {"runs after its inputs"}


@pytest.mark.parametrize("name", sorted(path.stem for path in (REPO / "experiments").glob("reproduce-*.yaml")))
def test_every_reproduction_plans_each_method_once_per_member(name):
    from repsim.flows.experiment import plan_experiment

    experiment = load_experiment(name)
    stages = plan_experiment(experiment)["stages"]
    trains = [stage for stage in stages if stage["stage"] == "train"]
    runs = experiment.section("train").methods
    per_point = sum(len(experiment.seeds or [None] if run.seeds is None else run.seeds) for run in runs)
    points = len(check_experiment(experiment)) // max(len(experiment.seeds), 1)
    assert [stage["stage"] for stage in stages].count("shard") == 1  # shared by every member
    assert per_point <= len(trains) <= points * per_point
    assert sum(stage["members"] for stage in trains) == points * per_point


def test_the_sop_reproduction_fills_its_memories_early_and_its_teacher_moves():
    from repsim.data.spec import load_spec
    from repsim.methods.config import load_config
    from repsim.methods.self_distillation import teacher_momentum

    experiment = load_experiment("reproduce-sop")
    train = experiment.section("train")
    images = round(10_000 * load_spec(experiment.data).split.fractions["train"])  # Animal-MNIST's 10000
    for run in train.methods:
        config = load_config(run.config, train.overrides(run, experiment.data))
        if config.method.name in ("supcon", "simclr"):  # the references: no teacher
            continue
        steps = images // config.optim.batch_size * config.optim.epochs
        kept = math.prod(teacher_momentum(step, steps, config.method.teacher_momentum) for step in range(steps))
        assert kept < 0.7, f"{run.label}: the teacher keeps {kept:.0%} of its initialisation"
        if config.method.name == "sop":
            cls_per_step = 2 * config.optim.batch_size  # the teacher's [CLS] of both global views
            assert config.method.cls_memory / cls_per_step <= 0.1 * steps, run.label
    full = load_experiment("reproduce-sop-full")
    assert {run.label: load_config(run.config, full.section("train").overrides(run, full.data)).method.num_prototypes
            for run in full.section("train").methods if run.label in ("dino", "ibot")} == {"dino": 8192, "ibot": 8192}


def _method_configs(name: str) -> dict[str, dict]:
    """label -> the resolved config (as a dict) of every train method of a shipped experiment."""
    from repsim.methods.config import load_config

    experiment = load_experiment(name)
    train = experiment.section("train")
    return {run.label: load_config(run.config, train.overrides(run, experiment.data)).model_dump()
            for run in train.methods}


def test_the_long_sop_run_is_the_sop_reproduction_at_five_times_its_epochs_plus_koleo_and_simclr_rows():
    long, short = _method_configs("reproduce-sop-long"), _method_configs("reproduce-sop")
    assert set(long) == {"sop", "sop-koleo", "supcon", "simclr"}
    short_epochs = {config["optim"].pop("epochs") for config in short.values()}
    assert {config["optim"].pop("epochs") for config in long.values()} == {5 * epochs for epochs in short_epochs}
    for label in ("sop", "supcon", "simclr"):
        assert long[label] == short[label], label
    assert long["sop-koleo"]["method"].pop("koleo_weight") == 0.1 and short["sop"]["method"].pop("koleo_weight") == 0
    assert long["sop-koleo"] == short["sop"]
    same_temperature = long["supcon"]["method"] | {"name": "simclr"}
    assert long["simclr"]["method"] == {"name": "simclr", "temperature": 0.1} == same_temperature
    assert long["simclr"] | {"method": None} == long["supcon"] | {"method": None}


def test_the_sop_run_at_8000_images_is_the_sop_reproduction_on_four_times_the_images_plus_koleo():
    larger, smaller = _method_configs("reproduce-sop-8000"), _method_configs("reproduce-sop")
    assert set(larger) == {"sop", "sop-koleo", "dino", "simclr"}
    assert {Path(config["data"].pop("spec")).name for config in larger.values()} == {"animal-mnist.yaml"}
    assert {Path(config["data"].pop("spec")).name for config in smaller.values()} == {"animal-mnist-2000.yaml"}
    for label in ("sop", "dino", "simclr"):
        assert larger[label] == smaller[label], label
    assert larger["sop-koleo"]["method"].pop("koleo_weight") == 0.1 and smaller["sop"]["method"].pop("koleo_weight") == 0
    assert larger["sop-koleo"] == smaller["sop"]


def _grid_configs(name: str) -> list[dict]:
    """The resolved config (as a dict) of every train method of every member of a shipped experiment but the
    untrained floor."""
    from repsim.methods.config import load_config

    return [load_config(run.config, member.experiment.section("train").overrides(run, member.experiment.data)).model_dump()
            for member in expand(load_experiment(name)) for run in member.experiment.section("train").methods
            if run.label != "untrained"]


def test_each_row_of_the_sop_designs_differs_from_its_base_row_in_one_factor():
    rows, ablations = _method_configs("sop-resnet"), _method_configs("sop-resnet-ablations")
    assert ablations["sop"] == rows["sop"]  # one SOP row: a store that holds one design serves it to the other
    rows |= ablations
    factors = {"sop-koleo": ("sop", {"koleo_weight"}), "dino-koleo": ("dino", {"koleo_weight"}),
               "koleo-only": ("sop-koleo", {"cls_weight"}), "sop-fixed": ("sop", {"fixed_anchors", "fixed_supports"}),
               "sop-anchors-64": ("sop", {"num_anchors"}), "sop-support-2": ("sop", {"support_size"}),
               "sop-memory-1024": ("sop", {"cls_memory"})}
    assert set(rows) == {"sop", "dino", "untrained", *factors}
    for label, (base, fields) in factors.items():
        differ = {name for name, value in rows[label]["method"].items() if rows[base]["method"][name] != value}
        assert differ == fields, label
        assert rows[label] | {"method": None} == rows[base] | {"method": None}, label


@pytest.mark.parametrize("design", ["sop-resnet", "sop-vit"])
def test_the_untrained_floor_of_a_sop_design_is_its_sop_row_before_any_step(design):
    rows = _method_configs(design)
    untrained, sop = rows["untrained"], rows["sop"]  # only max_steps differs
    assert untrained["optim"] == sop["optim"] | {"max_steps": 0} and untrained | {"optim": None} == sop | {"optim": None}


@pytest.mark.parametrize(("design", "grid", "methods"), [("sop-resnet", "sop-grid-resnet", {"sop", "dino"}),
                                                          ("sop-vit", "sop-grid-vit", {"sop", "dino", "ibot"})])
def test_the_sop_designs_base_rows_share_everything_but_the_method_and_sit_at_a_cell_of_their_grid(design, grid, methods):
    rows, cells = _method_configs(design), _grid_configs(grid)
    grid_points = math.prod(len(values) for values in load_experiment(grid).sweep.values())  # lr x views
    assert len(cells) == grid_points * len(methods) and grid_points >= 4
    assert len({json.dumps(rows[label] | {"method": None}, sort_keys=True, default=str) for label in methods}) == 1
    for config in [*(rows[label] for label in methods), *cells]:
        config["optim"].pop("seed")
    for label in methods:  # the grid's rows at one cell: its data, and its monitor on val
        assert rows[label] in [config for config in cells if config["method"]["name"] == label], label


def test_each_experiment_keeps_its_own_result_artifacts_under_a_key_prefect_accepts():
    from prefect.artifacts import Artifact

    from repsim.flows.experiment import artifact_key

    keys = [artifact_key(name) for name in ("animal-mnist", "Animal MNIST_v2", "sop-grid-resnet", "...")]
    assert keys == ["animal-mnist", "animal-mnist-v2", "sop-grid-resnet", "experiment"]
    for key in keys:
        Artifact(key=f"{key}-results-table", type="table", data="[]")  # Prefect's validation of the key
