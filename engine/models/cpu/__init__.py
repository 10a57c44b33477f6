"""specserve's CPU operators (csrc/) and the small-batch linear layer built on them."""
