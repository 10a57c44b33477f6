"""Placement groups against pods: every replica Serve may start (min and max scale) fits the pods of the group meant
for it, model workers fit no other group, and Ray's view of each pod agrees with Kubernetes'."""

from __future__ import annotations

import pytest

from . import fit


def test_pods_advertise_to_ray_what_kubernetes_gives_them(overlay_case):
    _, rs = overlay_case
    assert fit.pod_problems(rs) == []


@pytest.mark.parametrize("scale", ["min", "max"])
def test_every_replica_fits_the_pods_meant_for_it(overlay_case, scale):
    ov, rs = overlay_case
    placement = fit.place(rs, ov, scale)
    assert placement.problems == []
    _, cfg = fit.app_config_of(rs)
    targets = [k for k in placement.where if k.startswith("Target#")]
    drafts = [k for k in placement.where if k.startswith("Draft#")]
    routers = [k for k in placement.where if k.startswith("Router#")]
    count = (lambda s: s.max_replicas) if scale == "max" else (lambda s: s.min_replicas)
    assert (len(targets), len(drafts), len(routers)) == (count(cfg.target), count(cfg.draft), count(cfg.router))
    for key in targets:  # STRICT_PACK: the replica and all tp_size workers on one target pod
        assert len(placement.where[key]) == 1 + cfg.tp_size and len(set(placement.where[key])) == 1
        assert placement.where[key][0].startswith("target/")
    for key in drafts:
        assert placement.where[key][1].startswith("draft/")
    assert not any(placement.where[k][0].startswith("head/") for k in placement.where), "nothing on the head"


def test_model_workers_fit_only_their_own_group(overlay_case):
    _, rs = overlay_case
    assert fit.exclusivity_problems(rs) == []


def test_group_bounds_cover_the_deployments_bounds(overlay_case):
    _, rs = overlay_case
    assert fit.replica_bound_problems(rs) == []
