package dev.minikv;

/**
 * Positions seen (prompt + appended) and tokens kept in the cache, for one sequence and layer.
 */
public record SequenceLength(long tokensSeen, long tokensCached) {}
