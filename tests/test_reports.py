"""The reports' verdict rule: a claim is shown (✔ or ✗) only by a difference beyond one pooled standard
deviation over enough seeds, whichever way it points."""

import math
import sys

import pytest
from e2e import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from _report import Claim, pooled_std, verdict, verdict_table  # noqa: E402


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
