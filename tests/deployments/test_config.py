"""deployments/config.py: one default, serve_config.yaml's, and a section given in a config keeps its role's
defaults for the fields it leaves out."""

import pytest
import yaml

from deployments.config import ROLE_DEFAULTS, SpecServeConfig
from tests import REPO


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_serve_config_yaml_states_the_config_s_defaults():
    args = yaml.safe_load((REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    defaults = dict(_leaves(SpecServeConfig().model_dump()))
    differing = {name: (value, defaults.get(name, "<no such field>")) for name, value in _leaves(args)
                 if defaults.get(name, "<no such field>") != value}
    assert not differing, differing
    assert SpecServeConfig.model_validate(args) == SpecServeConfig()


def test_a_partial_section_keeps_its_role_s_defaults():
    cfg = SpecServeConfig.model_validate({"router": {"max_queued_requests": 3}, "target": {"max_replicas": 4}})
    assert cfg.router.max_queued_requests == 3 and cfg.router.num_cpus == ROLE_DEFAULTS["router"]["num_cpus"]
    assert cfg.target.max_replicas == 4 and cfg.target.niceness == 0 and cfg.target.target_ongoing_requests == 8
    assert cfg.draft == SpecServeConfig().draft


@pytest.mark.parametrize("overrides, message", [
    ({"runner": {"kind": "transformers"}}, "runner.kind"), ({"model": {"draft": "self:0"}}, "layer count")])
def test_a_drafter_inside_the_target_that_cannot_run_is_refused_naming_the_field(overrides, message):
    config = {"model": {"draft": "self"}, **overrides}
    config["model"] = {"draft": "self", **overrides.get("model", {})}
    with pytest.raises(ValueError, match=message):
        SpecServeConfig.model_validate(config)


def test_a_drafter_inside_the_target_runs_with_tensor_parallelism():
    config = SpecServeConfig.model_validate({"model": {"draft": "self:2"}, "tp_size": 2})
    assert config.draft_source().in_target and config.tp_size == 2


def test_the_default_drafts_by_n_gram_lookup_in_the_router():
    source = SpecServeConfig().draft_source()
    assert source.local is not None and not source.remote


def test_token_trees_take_yaml_switches_and_need_the_static_runner():
    for text, want in (("off", "off"), ("on", "on"), ("auto", "auto"), ('"on"', "on")):
        cfg = SpecServeConfig.model_validate(yaml.safe_load(f"speculation: {{tree: {text}, tree_nodes: 6}}"))
        assert cfg.speculation.tree == want and cfg.engine_config().tree == want
        assert cfg.engine_config().widest_verify == (6 if want != "off" else 3)
    with pytest.raises(ValueError, match="runner.kind"):
        SpecServeConfig.model_validate({"speculation": {"tree": "auto"}, "runner": {"kind": "transformers"}})
    with pytest.raises(ValueError, match="tree_nodes"):
        SpecServeConfig.model_validate({"speculation": {"tree_nodes": 16}})


def test_a_target_without_tree_attention_is_refused_at_start():
    from engine.factory import EngineConfig, check_trees
    from engine.models.transformers_runner import ModelRunner
    from tests.conftest import make_tiny_model

    runner = ModelRunner(make_tiny_model("llama"))
    check_trees(EngineConfig(tree="off"), runner)
    with pytest.raises(ValueError, match="speculation.tree: on needs the static runner"):
        check_trees(EngineConfig(tree="on"), runner)
