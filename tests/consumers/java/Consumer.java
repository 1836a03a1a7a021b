import dev.minikv.Backend;
import dev.minikv.Config;
import dev.minikv.Dtype;
import dev.minikv.KvCache;
import dev.minikv.MemoryStats;
import java.util.Arrays;

/**
 * A user's first program with the installed Java binding, compiled and run outside the source
 * tree (scripts/bindings-swig.sh): only minikv.jar on the class path and lib/jni on
 * java.library.path. Create, prefill, append, decode, stats, close on the CPU backend (the
 * constructor applies the version rule).
 */
public final class Consumer {
  public static void main(String[] args) {
    int heads = 4, kvHeads = 2, headDim = 64, prompt = 40;
    Config cfg = Config.builder().backend(Backend.CPU).dtype(Dtype.F32)
        .numLayers(1).numHeads(heads).numKvHeads(kvHeads).headDim(headDim)
        .maxSequences(1).maxSeqLen(128).build();
    float[] q = new float[prompt * heads * headDim];
    float[] k = new float[prompt * kvHeads * headDim];
    float[] v = new float[prompt * kvHeads * headDim];
    for (int i = 0; i < q.length; i++) {
      q[i] = (float) Math.sin(i);
    }
    for (int i = 0; i < k.length; i++) {
      k[i] = (float) Math.cos(i);
      v[i] = 0.5f; // attention of a constant is that constant
    }
    int[] seq = {0};
    try (KvCache cache = new KvCache(cfg)) {
      float[] out = new float[q.length];
      cache.prefill(0, seq, new int[] {0, prompt}, q, k, v, out);
      cache.append(0, seq, Arrays.copyOf(k, kvHeads * headDim),
          Arrays.copyOf(v, kvHeads * headDim));
      float[] o = new float[heads * headDim];
      cache.decode(0, seq, Arrays.copyOf(q, heads * headDim), o);
      for (float[] a : new float[][] {out, o}) {
        for (float x : a) {
          if (Math.abs(x - 0.5f) > 1e-6f) {
            throw new AssertionError("output " + x + ", want 0.5");
          }
        }
      }
      MemoryStats st = cache.memoryStats();
      if (st.tokensSeen() != prompt + 1) {
        throw new AssertionError("stats " + st);
      }
      System.out.println("Java consumer OK: libminikv " + KvCache.version() + ", backend "
          + cache.backend() + ", " + st.tokensCached() + " of " + st.tokensSeen()
          + " tokens kept");
    }
  }
}
