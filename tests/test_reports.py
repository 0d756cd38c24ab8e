"""The reports' verdict rule: a claim is shown (✔ or ✗) only by a difference beyond one pooled standard
deviation over enough seeds, whichever way it points."""

import math
import sys

import pytest
from e2e import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from _report import HERE, Claim, kept_section, pooled_std, verdict, verdict_table  # noqa: E402


def row(encoder: str, mean: float, std: float, n: int = 3) -> dict:
    return {"encoder": encoder, "knn_top1_k20": mean, "knn_top1_k20.std": std, "knn_top1_k20.n": n}


def test_the_pooled_std_is_the_root_mean_square_of_the_two_sample_stds():
    assert pooled_std(row("a", 0.8, 0.03), row("b", 0.7, 0.04), "knn_top1_k20") == pytest.approx(math.sqrt(0.00125))


@pytest.mark.parametrize(("better", "worse", "mark"), [
    (0.850, 0.800, "✔"),   # +5 points against a pooled std of 1
    (0.800, 0.850, "✗"),   # −5
    (0.805, 0.800, "not shown"),  # +0.5: within one pooled std
    (0.800, 0.805, "not shown"),  # −0.5: the same, the other way
])
def test_a_claim_is_shown_either_way_only_beyond_one_pooled_std(better, worse, mark):
    found, why = verdict(row("sop", better, 0.01), row("dino", worse, 0.01), "knn_top1_k20")
    assert found == mark
    assert "pooled std 1.00" in why


def test_too_few_seeds_or_a_row_not_run_shows_nothing_but_the_pixels_need_one():
    assert verdict(row("sop", 0.9, 0.0, n=2), row("dino", 0.5, 0.0), "knn_top1_k20") == (
        "not shown", "sop has 2 of the 3 seeds")
    assert verdict(row("sop", 0.9, 0.01), None, "knn_top1_k20") == ("not shown", "not run")
    assert verdict(row("sop", 0.9, 0.01), row("pixels", 0.8, 0.0, n=1), "knn_top1_k20")[0] == "✔"


def test_the_verdict_table_has_a_row_per_claim_with_both_measurements():
    claims = [Claim("SOP beats DINO", "paper", "sop", "dino"), Claim("fixed collapse", "paper", "sop", "sop-fixed")]
    table = verdict_table(claims, [row("sop", 0.85, 0.01), row("dino", 0.80, 0.01)], str.upper).splitlines()
    assert len(table) == 2 + len(claims)
    assert "SOP 85.00 ± 1.00 (3) vs DINO 80.00 ± 1.00 (3) | ✔ |" in table[2]
    assert table[3].endswith("| not shown | not run |")


def test_the_sop_report_reads_grid_points_as_the_sweep_labels_them_and_picks_the_best_mean():
    from sop_report import grid_cells, point_settings, shared_settings

    two_views = "lr=0.0005 preset_options={global_scale: [0.5, 1.0], local_crops: 0}"
    assert point_settings(two_views) == (0.0005, {"global_scale": [0.5, 1.0], "local_crops": 0})
    assert point_settings("lr=0.002 preset_options={local_crops: 4}") == (0.002, {"local_crops": 4})
    rows = [row("sop", 0.70, 0) | {"point": two_views}, row("dino", 0.80, 0) | {"point": two_views},
            row("sop", 0.60, 0) | {"point": "lr=0.002 preset_options={local_crops: 4}"},
            row("dino", 0.95, 0) | {"point": "lr=0.002 preset_options={local_crops: 4}"}]
    best, second = grid_cells(type("Run", (), {"rows": rows})(), ("sop", "dino"))
    assert best["point"] == "lr=0.002 preset_options={local_crops: 4}" and best["mean"] == pytest.approx(0.775)
    assert second["mean"] == pytest.approx(0.75)
    from repsim.experiment import load_experiment

    grid, (lr, views) = load_experiment("sop-grid-resnet").sweep, shared_settings("sop-resnet")
    assert lr in grid["train.settings.optim.lr"] and views in grid["train.settings.data.preset_options"]


def test_a_design_on_another_dataset_cites_the_report_whose_grid_chose_its_settings(monkeypatch):
    import sop_report

    (design,) = sop_report.DATASETS["fashion-mnist"]
    monkeypatch.setattr(sop_report, "optional_run", lambda *_: pytest.fail("a borrowed grid is not read from the store"))
    (text,) = sop_report.settings_section(design, type("Run", (), {"source": "sop-resnet"})())
    assert "lr 0.0001 with 2 global views" in text and f"`{design.grid_report}`" in text
    cited = kept_section(HERE / design.grid_report, "### The settings, chosen on validation")
    assert "| 0.0001 | 2 global views |" in next(line for line in cited.splitlines() if "(chosen)" in line)


def test_the_sop_report_rewrites_the_sections_this_store_ran_and_keeps_the_others_as_written(tmp_path, monkeypatch):
    import sop_report

    factorial, ablations, vit = sop_report.DATASETS["animal-mnist"]
    path = tmp_path / "REPORT_sop-animal-mnist.md"
    path.write_text(f"# SOP\n\n## {factorial.title}\n\nrun elsewhere: 78.75\n\n### Scores\n\n| a |\n\n"
                    f"## {vit.title}\n\nan older ViT run\n\n## Analysis\n\nhand-written\n")
    monkeypatch.setattr(sop_report, "optional_run", lambda name, absent: name if name == vit.experiment else None)
    monkeypatch.setattr(sop_report, "design_section", lambda design, run, image: f"## {design.title}\n\nnew: {run}\n")
    text = sop_report.report("animal-mnist", path)
    assert f"## {factorial.title}\n\nrun elsewhere: 78.75\n\n### Scores\n\n| a |\n" in text  # kept whole
    assert f"## {vit.title}\n\nnew: sop-vit\n" in text and "an older ViT run" not in text
    assert ablations.title not in text and "Analysis" not in text  # neither run nor held; the analysis is kept apart


def test_gera_few_pairs_chooses_per_m_on_validation_among_positive_weights_and_pairs_rows_at_that_choice():
    from gera_few_pairs import chosen, test_rows

    def align(point: str, score: float, asif: float = 0.5, encoder: str = "simclr") -> dict:
        return {"point": point, "encoder": encoder, "zeroshot_top1": score, "zeroshot_top1.std": 0.01,
                "zeroshot_top1.n": 10, "asif_zeroshot_top1": asif, "asif_zeroshot_top1.std": 0.02,
                "asif_zeroshot_top1.n": 10}
    tuning = [align("pairs=20 alpha=0.0 count=50", 0.9), align("pairs=20 alpha=100.0 count=50", 0.4),
              align("pairs=20 alpha=1000.0 count=200", 0.5), align("pairs=50 alpha=100.0 count=800", 0.6)]
    choice = chosen(type("Run", (), {"rows": tuning})())
    assert choice == {20: (1000.0, 200.0), 50: (100.0, 800.0)}  # α = 0 is not GeRA, whatever it scores
    test = [align("pairs=20 alpha=1000.0 count=200", 0.45, asif=0.47), align("pairs=20 alpha=0.0 count=200", 0.44),
            align("pairs=20 alpha=0.0 count=50", 0.1), align("pairs=20 alpha=1000.0 count=200", 0.3, encoder="pixels")]
    named = {found["encoder"]: found["zeroshot_top1"] for found in test_rows(type("Run", (), {"rows": test})(), choice)}
    assert named == {"gera-20": 0.45, "asif-20": 0.47, "contrastive-20": 0.44, "gera-pixels-20": 0.3}


def test_gera_few_pairs_pairs_seeds_and_counts_a_win_only_where_gera_scores_higher():
    from gera_few_pairs import paired_gains, seeds_table

    paired = {20: {0: (40.0, 50.0), 1: (52.0, 50.0), 2: (50.0, 50.0)}}  # (GeRA, contrastive alone) per seed
    assert paired_gains(paired) == {20: "-2.67 ± 6.43 (1/3)"}  # −10, +2, 0: a tie is no win
    assert "| 20 | 0 | 40.0 | 50.0 | -10.0 |" in seeds_table(paired).splitlines()


def test_a_logged_row_gets_back_the_columns_the_table_leaves_out_where_they_say_nothing():
    from _report import _complete

    assert _complete({"encoder": "pixels", "knn_top1_k20": 0.4, "linear_top1": None}) == {
        "point": "", "encoder": "pixels", "knn_top1_k20": 0.4, "knn_top1_k20.n": 1, "knn_top1_k20.std": None,
        "linear_top1": None, "linear_top1.n": None, "linear_top1.std": None}
    spread = {"point": "lr=0.1", "encoder": "sop", "knn_top1_k20": 0.6, "knn_top1_k20.std": 0.01, "knn_top1_k20.n": 3}
    assert _complete(spread) == spread


def test_the_contrastive_report_opens_with_a_verdict_per_claim_on_the_rows_it_compares():
    from reproduce_contrastive import CLAIMS, name

    rows = [row("pixels", 0.88, 0.0, n=1), row("simclr", 0.89, 0.004), row("xclr-captions", 0.976, 0.002),
            row("clip", 0.965, 0.003)]
    table = verdict_table(list(CLAIMS), rows, name)
    assert "| X-CLR's soft targets beat SimCLR's (captions graph) | paper | kNN top-1 (k = 20) | X-CLR (captions) " \
           "97.60 ± 0.20 (3) vs SimCLR 89.00 ± 0.40 (3) | ✔ |" in table
    assert "| SimCLR beats the raw pixels | floor | kNN top-1 (k = 20) | SimCLR 89.00 ± 0.40 (3) vs raw pixels (floor) " \
           "88.00 ± 0.00 (1) | ✔ |" in table
    linear = [line for line in table.splitlines() if "| linear top-1 |" in line]
    assert linear and all(line.endswith("| not shown | not run |") for line in linear)  # no linear scores given


def test_the_gera_rows_are_named_per_m_and_asif_is_scored_on_geras_row():
    from reproduce_gera import ZERO_SHOT, by_pairs, gera_claims, label, named_rows

    def aligned(encoder, point, score, asif=None):
        found = {"encoder": encoder, "point": point, ZERO_SHOT: score, f"{ZERO_SHOT}.std": 0.01, f"{ZERO_SHOT}.n": 10}
        return found | ({"asif_zeroshot_top1": asif, "asif_zeroshot_top1.std": 0.02, "asif_zeroshot_top1.n": 10}
                        if asif is not None else {})

    rows = [aligned("simclr", "pairs=20 alpha=0.0", 0.49), aligned("simclr", "pairs=20 alpha=1000.0", 0.47, 0.40),
            aligned("pixels", "pairs=20 alpha=1000.0", 0.30, 0.25)]
    named = {found["encoder"]: found[ZERO_SHOT] for found in named_rows(by_pairs(rows))}
    assert named == {"gera-20": 0.47, "contrastive-20": 0.49, "asif-20": 0.40, "gera-pixels-20": 0.30}
    table = verdict_table(gera_claims([20]), named_rows(by_pairs(rows)), label).splitlines()
    assert table[2].startswith("| GeRA beats contrastive alignment alone at M = 20 |")
    assert table[2].endswith("| ✗ | -2.00 points, pooled std 1.00 |")
    assert "| ✔ |" in table[3] and "ASIF (M = 20) 40.00 ± 2.00 (10)" in table[3]
