package dev.minikv;

/**
 * The cache's memory statistics ({@code minikv_memory_stats}), exact, from its bookkeeping.
 *
 * @param poolBytes reserved for KV storage: blocks + residuals + position index
 * @param usedBytes codes + scales/zero-points of quantized tokens + 16-bit tokens in use
 * @param workspaceBytes scratch reserved for prefill/decode
 * @param tokensSeen prompt + appended positions, summed over sequences and layers
 * @param tokensCached of those, kept in the cache
 * @param fp16EquivalentBytes tokensSeen * numKvHeads * headDim * 2 (K,V) * 2 bytes
 * @param compressionRatio 1 - usedBytes / fp16EquivalentBytes; 0 when empty
 */
public record MemoryStats(
    long poolBytes,
    long usedBytes,
    long workspaceBytes,
    long tokensSeen,
    long tokensCached,
    long fp16EquivalentBytes,
    double compressionRatio) {}
