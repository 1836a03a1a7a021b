// The generic decode kernel's instances for head_dim 128 (decode_generic.cuh).
#include "decode_generic.cuh"

MINIKV_DECODE_GENERIC_HEAD_DIM(128)
