"""The maths of a speculative round: how many tokens to draft, the samplers that accept them, and the
counter-based randomness that makes seeded sampling reproducible. Never imports the models."""
