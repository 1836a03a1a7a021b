/*
 * bench.h — minikv-engine --bench: per-token latency against context length at batch 1,
 * and tokens per second at the largest batch a memory limit holds, for the full 16-bit
 * cache and MiniKV settings, on random-weight models of real shapes (bench.c).
 */
#ifndef ENGINE_BENCH_H
#define ENGINE_BENCH_H

/* The whole --bench mode: parses its own flags from argv; returns the exit status. */
int bench_main(int argc, char **argv);

#endif /* ENGINE_BENCH_H */
