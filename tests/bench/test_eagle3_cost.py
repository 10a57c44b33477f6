"""bench/eagle3_cost.py runs end to end at a reduced shape (its figures come from a GPU: bench/gpu_check.sh eagle3)."""

import json

from bench.eagle3_cost import main


def test_the_cost_check_reports_a_drafting_share_per_batch(tmp_path, capsys):
    out = tmp_path / "cost.json"
    main(["--tiny", "--layers", "8", "--batches", "1,2", "--reps", "1", "--context", "32", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["aux_layers"] == [2, 4, 5] and report["target"]["hidden_size"] == 256
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    assert all(r["target_step_ms"] > 0 and r["draft_token_over_step"] > 0 for r in report["rows"])
    assert "share of a step" in capsys.readouterr().out
