"""Start-up cost measurements the round plan (engine/spec/plan.py) decides with, and their on-disk cache."""
