"""Start-up cost measurements the draft-length policy decides with, and their on-disk cache."""
