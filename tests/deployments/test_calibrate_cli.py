"""`specserve-calibrate` on tiny models: it writes a profile the config accepts as `speculation.calibration`."""

import yaml

from deployments.calibrate import main
from engine.spec.policy import CostProfile
from tests.deployments.conftest import tiny_config


def test_calibrate_writes_a_profile_the_config_accepts(tiny_model_dirs, tmp_path, capsys):
    args = tiny_config(tiny_model_dirs).model_dump(mode="json")
    config = tmp_path / "serve_config.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "specserve", "args": args}]}))
    out = tmp_path / "calibration.json"
    assert main(["--config", str(config), "--out", str(out), "--reps", "1"]) == 0
    profile = CostProfile.from_json(out)
    assert profile.batch_sizes == (1, 2, 4, 8, 16) and profile.max_k == args["speculation"]["num_speculative_tokens"]
    assert all(t > 0 for t in profile.draft_step_seconds) and profile.draft_prefill_seconds_per_token > 0
    assert "knee" in capsys.readouterr().out
    tiny_config(tiny_model_dirs, speculation={"calibration": str(out)})  # validates as a profile


def test_the_printed_ks_and_knee_are_the_round_plans(tmp_path):
    """The table `specserve-calibrate` prints comes from the served rounds' plan (engine/spec/plan.plan_round): on a
    profile where drafting pays up to two rows, b rows of one acceptance draft at 1 and 2 rows, never beyond."""
    from deployments.calibrate import knee, planned_k
    from tests.deployments.conftest import write_profile

    profile = CostProfile.from_json(write_profile(tmp_path / "costs.json", knee_batch=2))
    for acceptance in (0.5, 0.9):
        assert [planned_k(profile, b, acceptance, 3) > 0 for b in (1, 2, 3, 8, 32)] == [True, True, False, False, False]
        assert knee(profile, acceptance, 3) == 2
    assert planned_k(profile, 1, 0.5, 3) < planned_k(profile, 1, 0.9, 3) == 3, "fewer drafts where fewer agree"
