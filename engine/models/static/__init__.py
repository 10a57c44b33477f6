"""The fast runner: a static Llama-family forward over a preallocated, slotted KV cache, its attention
kernels, CUDA graphs, prefix cache and tensor-parallel form."""
