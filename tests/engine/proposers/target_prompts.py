"""The prompts and greedy settings the target-side drafters' tests (early exit, Medusa) decode."""

from engine import SamplingParams

PROMPTS = [[2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 20, 21, 22, 20, 21]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
