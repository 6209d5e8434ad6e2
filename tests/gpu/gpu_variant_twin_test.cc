// tests/gpu/gpu_variant_twin_test.cc — tests/variant_twin_test.cc for the CUDA backend's
// variants: each against transformers' logits within its bound, and bitwise the CPU's where it
// declares cpu_bits. Skips without a CUDA device.
#define LOCKSTEP_TWIN_BACKEND "cuda"
#define LOCKSTEP_TWIN_GPU 1
#include "../variant_twin_test.cc"
