import dev.minikv.Backend;
import dev.minikv.Config;
import dev.minikv.Half;
import dev.minikv.KvCache;
import dev.minikv.MemoryStats;
import dev.minikv.MinikvException;
import java.util.Random;

/**
 * create → prefill → append → decode → stats → destroy with libminikv's Java binding on the
 * CPU backend, in the paper's setting (FP16, 2-bit keys and values, group 16, heavy and recent
 * budgets of 25% each): one layer, GQA 8/2 heads of 128, two prompts of 1000 and 600 tokens,
 * 200 decode steps. Prints the compression and the error of the last decode against exact
 * float64 attention over every token the "model" produced.
 *
 * <p>The synthetic data has what makes eviction work on real models: a few prompt tokens
 * (5%) whose keys share a direction with every query, so they draw most of the attention.
 *
 * <p>Run: java -Djava.library.path=DIR_OF_LIBMINIKV_JNI -cp minikv.jar:. MinikvExample
 */
public final class MinikvExample {
  static final int H = 8, HKV = 2, D = 128, STEPS = 200;
  static final Random RNG = new Random(7);
  static final float[][] TOPIC = new float[HKV][D]; // one unit direction per KV head

  public static void main(String[] args) {
    Config cfg = Config.builder().backend(Backend.CPU).numLayers(1).numHeads(H).numKvHeads(HKV)
        .headDim(D).maxSequences(2).maxSeqLen(2048).build(); // the defaults: Preset.BALANCED
    System.out.println("libminikv " + KvCache.version() + ": " + cfg);
    for (float[] t : TOPIC) {
      double n = 0;
      for (int i = 0; i < D; i++) {
        t[i] = (float) RNG.nextGaussian();
        n += t[i] * t[i];
      }
      for (int i = 0; i < D; i++) {
        t[i] /= (float) Math.sqrt(n);
      }
    }
    int[] seqs = {0, 1};
    int[] lens = {1000, 600};
    int[] cu = {0, lens[0], lens[0] + lens[1]};
    int total = cu[2];
    // Every K/V row ever produced, per sequence, as the FP16 values the cache received.
    float[][] keys = new float[2][], vals = new float[2][];
    for (int s = 0; s < 2; s++) {
      keys[s] = new float[(lens[s] + STEPS) * HKV * D];
      vals[s] = new float[(lens[s] + STEPS) * HKV * D];
    }
    float[] q = new float[total * H * D], k = new float[total * HKV * D];
    float[] v = new float[total * HKV * D];
    for (int t = 0; t < total; t++) {
      query(q, t);
      keyValue(k, v, t, RNG.nextDouble() < 0.05);
    }
    for (int s = 0; s < 2; s++) {
      System.arraycopy(k, cu[s] * HKV * D, keys[s], 0, lens[s] * HKV * D);
      System.arraycopy(v, cu[s] * HKV * D, vals[s], 0, lens[s] * HKV * D);
    }

    try (KvCache cache = new KvCache(cfg)) {
      cache.prefill(0, seqs, cu, Half.f16Bits(q), Half.f16Bits(k), Half.f16Bits(v),
          new short[total * H * D]);
      float[] q1 = new float[2 * H * D];
      short[] out = new short[2 * H * D];
      for (int step = 0; step < STEPS; step++) {
        float[] k1 = new float[2 * HKV * D], v1 = new float[2 * HKV * D];
        for (int s = 0; s < 2; s++) {
          keyValue(k1, v1, s, false);
          query(q1, s);
        }
        cache.append(0, seqs, Half.f16Bits(k1), Half.f16Bits(v1));
        for (int s = 0; s < 2; s++) {
          System.arraycopy(k1, s * HKV * D, keys[s], (lens[s] + step) * HKV * D, HKV * D);
          System.arraycopy(v1, s * HKV * D, vals[s], (lens[s] + step) * HKV * D, HKV * D);
        }
        cache.decode(0, seqs, Half.f16Bits(q1), out);
      }

      MemoryStats st = cache.memoryStats();
      System.out.printf("tokens seen %d, kept %d; %d bytes in use vs %d for an FP16 cache: "
          + "compression %.1f%%%n", st.tokensSeen(), st.tokensCached(), st.usedBytes(),
          st.fp16EquivalentBytes(), 100 * st.compressionRatio());
      for (int s = 0; s < 2; s++) {
        double[] exact = attend(q1, s, keys[s], vals[s], lens[s] + STEPS);
        double err = 0, norm = 0;
        for (int i = 0; i < H * D; i++) {
          err += Math.pow(Half.f16Float(out[s * H * D + i]) - exact[i], 2);
          norm += exact[i] * exact[i];
        }
        System.out.printf("sequence %d: last decode vs exact attention, relative L2 error %.4f%n",
            s, Math.sqrt(err / norm));
      }
      try {
        cache.decode(0, new int[] {7}, Half.f16Bits(new float[H * D]), new short[H * D]);
      } catch (MinikvException e) {
        System.out.println("a bad call throws: " + e.status() + " (" + e.getMessage() + ")");
      }
    } // close(): minikv_cache_destroy
  }

  /** Row t of q: noise plus 2.5 along its KV head's topic. */
  static void query(float[] q, int t) {
    for (int h = 0; h < H; h++) {
      float[] topic = TOPIC[h / (H / HKV)];
      for (int i = 0; i < D; i++) {
        q[(t * H + h) * D + i] = round((float) (RNG.nextGaussian() + 2.5 * topic[i]));
      }
    }
  }

  /** Row t of k and v; an important token's key has 2.5 * sqrt(D) along the topic. */
  static void keyValue(float[] k, float[] v, int t, boolean important) {
    for (int h = 0; h < HKV; h++) {
      for (int i = 0; i < D; i++) {
        double along = important ? 2.5 * Math.sqrt(D) * TOPIC[h][i] : 0;
        k[(t * HKV + h) * D + i] = round((float) (RNG.nextGaussian() + along));
        v[(t * HKV + h) * D + i] = round((float) RNG.nextGaussian());
      }
    }
  }

  static float round(float x) {
    return Half.f16Float(Half.f16Bits(x));
  }

  /** Exact float64 attention of sequence s's query over its first n tokens. */
  static double[] attend(float[] q, int s, float[] keys, float[] vals, int n) {
    double[] out = new double[H * D];
    double[] p = new double[n];
    for (int h = 0; h < H; h++) {
      int kh = h / (H / HKV);
      double max = Double.NEGATIVE_INFINITY, sum = 0;
      for (int t = 0; t < n; t++) {
        double dot = 0;
        for (int i = 0; i < D; i++) {
          dot += (double) q[(s * H + h) * D + i] * keys[(t * HKV + kh) * D + i];
        }
        p[t] = dot / Math.sqrt(D);
        max = Math.max(max, p[t]);
      }
      for (int t = 0; t < n; t++) {
        p[t] = Math.exp(p[t] - max);
        sum += p[t];
      }
      for (int t = 0; t < n; t++) {
        for (int i = 0; i < D; i++) {
          out[h * D + i] += p[t] / sum * vals[(t * HKV + kh) * D + i];
        }
      }
    }
    return out;
  }
}
