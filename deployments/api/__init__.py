"""The OpenAI-compatible HTTP API: routes, request parameters, response bodies, errors, health."""
