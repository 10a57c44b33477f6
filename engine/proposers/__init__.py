"""Draft proposers behind one Protocol: where a round's draft tokens come from."""
