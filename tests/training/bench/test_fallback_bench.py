"""masc bench fallback: every score of both stages of the OOD rule timed beside the MAR pass."""

from masc_gadget.cli import main
from masc_gadget.core.ood import GIVEN_SCORES, SCORES
from masc_gadget.models.unet import MarModelConfig, build_mar
from training.bench.fallback import bench_fallback, format_table


def test_every_score_of_both_stages_is_timed():
    rows = bench_fallback(build_mar(MarModelConfig(width=4)).eval(), 16, 2, repeats=2)
    assert [(r["step"], r["score"]) for r in rows[1:]] == [
        (step, kind) for kind in SCORES for step in ("early switch", "end-of-scan rule", "score alone")
    ] + [("early switch", kind) for kind in GIVEN_SCORES]  # an early rule's scores only
    assert all(r["median_ms"] > 0 and r["p90_ms"] >= r["median_ms"] for r in rows)
    assert "| early switch | flip |" in format_table(rows)


def test_the_command_names_a_bad_size(capsys):
    assert main(["bench", "fallback", "--size", "4"]) != 0
    assert "--size >= 8" in capsys.readouterr().err
