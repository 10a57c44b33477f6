"""The KubeRay manifests, their overlays and their generator (`python -m k8s.manifests`); not installed."""
