package dev.minikv;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertDoesNotThrow;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import org.junit.jupiter.api.Test;

/** The lifecycle on the CPU backend, checked against float64 attention and the layout. */
class KvCacheTest {
  static final int H = 4, HKV = 2, D = 32, LAYERS = 2; // GQA group of 2

  // ---- float64 reference -----------------------------------------------------------------

  /** softmax(q K^T / sqrt(D)) V for one token; query head h reads KV head h / (H / Hkv). */
  static double[] attend(double[] q, List<double[]> keys, List<double[]> vals, int h, int hkv,
      int d) {
    double[] out = new double[h * d];
    double[] logits = new double[keys.size()];
    int group = h / hkv;
    double scale = 1 / Math.sqrt(d);
    for (int head = 0; head < h; head++) {
      int kh = head / group;
      double max = Double.NEGATIVE_INFINITY;
      for (int t = 0; t < keys.size(); t++) {
        double dot = 0;
        for (int i = 0; i < d; i++) {
          dot += q[head * d + i] * keys.get(t)[kh * d + i];
        }
        logits[t] = dot * scale;
        max = Math.max(max, logits[t]);
      }
      double sum = 0;
      for (int t = 0; t < keys.size(); t++) {
        logits[t] = Math.exp(logits[t] - max);
        sum += logits[t];
      }
      for (int t = 0; t < vals.size(); t++) {
        double p = logits[t] / sum;
        for (int i = 0; i < d; i++) {
          out[head * d + i] += p * vals.get(t)[kh * d + i];
        }
      }
    }
    return out;
  }

  static double maxAbsDiff(String what, float[] got, int from, double[] want) {
    double worst = 0;
    for (int i = 0; i < want.length; i++) {
      float g = got[from + i];
      if (!Float.isFinite(g)) {
        fail(what + ": element " + i + " is " + g);
      }
      worst = Math.max(worst, Math.abs(g - want[i]));
    }
    return worst;
  }

  static float[] uniform(Random rng, int n) {
    float[] a = new float[n];
    for (int i = 0; i < n; i++) {
      a[i] = rng.nextFloat() * 2 - 1;
    }
    return a;
  }

  static double[] row(float[] a, int index, int width) {
    double[] r = new double[width];
    for (int i = 0; i < width; i++) {
      r[i] = a[index * width + i];
    }
    return r;
  }

  /** Keep everything (heavy 1, recent 0), unquantized (bits 16, no sinks), residual 16. */
  static Config exact(Dtype dtype) {
    return Config.builder().preset(Preset.EVICTION_ONLY).backend(Backend.CPU).dtype(dtype)
        .numLayers(LAYERS).numHeads(H)
        .numKvHeads(HKV).headDim(D).maxSequences(4).maxSeqLen(256).heavyRatio(1)
        .recentRatio(0).keyBits(16).valueBits(16).groupSize(16).residualLength(16).build();
  }

  /** The K/V rows one (sequence, layer) has seen, for the reference. */
  static final class History {
    final List<double[]> keys = new ArrayList<>();
    final List<double[]> vals = new ArrayList<>();
  }

  /** Drives an F32 cache and checks each output row against attend(). */
  static final class Model {
    final KvCache cache;
    final Random rng;
    final Map<String, History> hist = new HashMap<>();
    double worst;

    Model(KvCache cache, long seed) {
      this.cache = cache;
      this.rng = new Random(seed);
    }

    void prefill(int[] seqs, int[] lens) {
      int[] cu = new int[seqs.length + 1];
      for (int s = 0; s < seqs.length; s++) {
        cu[s + 1] = cu[s] + lens[s];
      }
      int total = cu[seqs.length];
      for (int layer = 0; layer < LAYERS; layer++) {
        float[] q = uniform(rng, total * H * D);
        float[] k = uniform(rng, total * HKV * D);
        float[] v = uniform(rng, total * HKV * D);
        float[] out = new float[total * H * D];
        cache.prefill(layer, seqs, cu, q, k, v, out);
        for (int s = 0; s < seqs.length; s++) {
          History h = new History();
          hist.put(seqs[s] + "/" + layer, h);
          for (int tok = cu[s]; tok < cu[s + 1]; tok++) {
            h.keys.add(row(k, tok, HKV * D));
            h.vals.add(row(v, tok, HKV * D));
            check("prefill seq " + seqs[s] + " token " + tok, out, tok * H * D,
                attend(row(q, tok, H * D), h.keys, h.vals, H, HKV, D));
          }
        }
      }
    }

    void step(int[] seqs) {
      int n = seqs.length;
      for (int layer = 0; layer < LAYERS; layer++) {
        float[] k = uniform(rng, n * HKV * D);
        float[] v = uniform(rng, n * HKV * D);
        cache.append(layer, seqs, k, v);
        float[] q = uniform(rng, n * H * D);
        float[] out = new float[n * H * D];
        cache.decode(layer, seqs, q, out);
        for (int s = 0; s < n; s++) {
          History h = hist.get(seqs[s] + "/" + layer);
          h.keys.add(row(k, s, HKV * D));
          h.vals.add(row(v, s, HKV * D));
          check("decode seq " + seqs[s] + " layer " + layer, out, s * H * D,
              attend(row(q, s, H * D), h.keys, h.vals, H, HKV, D));
        }
      }
    }

    void check(String what, float[] out, int from, double[] want) {
      double d = maxAbsDiff(what, out, from, want);
      worst = Math.max(worst, d);
      if (d > 2e-5) {
        fail(what + ": max |out - reference| = " + d);
      }
    }
  }

  static void checkStats(KvCache cache, long tokens) {
    MemoryStats st = cache.memoryStats();
    long perToken = 2L * HKV * D;
    assertEquals(tokens, st.tokensSeen(), "tokensSeen");
    assertEquals(tokens, st.tokensCached(), "tokensCached");
    assertEquals(tokens * perToken * 4, st.usedBytes(), "usedBytes (F32 storage)");
    assertEquals(tokens * perToken * 2, st.fp16EquivalentBytes(), "fp16EquivalentBytes");
    if (tokens > 0) {
      assertEquals(-1.0, st.compressionRatio(), "F32 storage is twice FP16");
    }
    assertTrue(st.poolBytes() >= st.usedBytes() && st.poolBytes() > 0);
  }

  // ---- tests -----------------------------------------------------------------------------

  @Test
  void lifecycleEqualsExactAttention() {
    KvCache cache = new KvCache(exact(Dtype.F32));
    try (cache) {
      Model m = new Model(cache, 1);
      int[] seqs = {0, 2, 3};
      int[] lens = {37, 50, 21};
      m.prefill(seqs, lens);
      for (int s = 0; s < seqs.length; s++) {
        for (int kv = 0; kv < HKV; kv++) {
          int[] pos = cache.keptPositions(seqs[s], 1, kv);
          int[] all = new int[lens[s]];
          for (int i = 0; i < all.length; i++) {
            all[i] = i;
          }
          assertArrayEquals(all, pos, "keep-everything keeps every position");
        }
      }
      int steps = 40; // residual 16: two or three flushes per sequence
      for (int i = 0; i < steps; i++) {
        m.step(seqs);
      }
      long total = 0;
      for (int s = 0; s < seqs.length; s++) {
        SequenceLength len = cache.sequenceLength(seqs[s], 1);
        assertEquals(lens[s] + steps, len.tokensSeen());
        assertEquals(lens[s] + steps, len.tokensCached());
        total += (long) (lens[s] + steps) * LAYERS;
      }
      checkStats(cache, total);

      cache.release(2);
      total -= (long) (50 + steps) * LAYERS;
      checkStats(cache, total);
      assertEquals(new SequenceLength(0, 0), cache.sequenceLength(2, 0));
      MinikvException e = assertThrows(MinikvException.class,
          () -> cache.decode(0, new int[] {2}, new float[H * D], new float[H * D]));
      assertEquals(Status.BAD_STATE, e.status());
      cache.release(2); // an empty slot: no-op

      m.prefill(new int[] {2}, new int[] {29});
      for (int i = 0; i < 20; i++) {
        m.step(new int[] {3, 0, 2});
      }
      total += 2L * 20 * LAYERS + (29L + 20) * LAYERS;
      checkStats(cache, total);
      System.out.printf("worst |decode - float64 attention| = %.3g%n", m.worst);
    }
    assertTrue(cache.isClosed());
    assertDoesNotThrow(cache::close); // idempotent
  }

  @Test
  void f16AndDirectBuffers() {
    try (KvCache cache = new KvCache(exact(Dtype.F16))) {
      Random rng = new Random(2);
      int len = 45;
      int layer = 1;
      float[] q = uniform(rng, len * H * D);
      float[] k = uniform(rng, len * HKV * D);
      float[] v = uniform(rng, len * HKV * D);
      short[] qb = bits(q), kb = bits(k), vb = bits(v); // rounds q, k, v to fp16 in place
      // Prefill through direct ByteBuffers, decode through short[].
      ByteBuffer out = ByteBuffer.allocateDirect(len * H * D * 2).order(ByteOrder.nativeOrder());
      cache.prefill(layer, new int[] {1}, new int[] {0, len}, direct(qb), direct(kb), direct(vb),
          out);
      List<double[]> keys = new ArrayList<>(), vals = new ArrayList<>();
      double worst = 0;
      for (int t = 0; t < len; t++) {
        keys.add(row(k, t, HKV * D));
        vals.add(row(v, t, HKV * D));
        float[] got = new float[H * D];
        for (int i = 0; i < got.length; i++) {
          got[i] = Half.f16Float(out.getShort((t * H * D + i) * 2));
        }
        worst = Math.max(worst, maxAbsDiff("prefill f16", got, 0,
            attend(row(q, t, H * D), keys, vals, H, HKV, D)));
      }
      for (int step = 0; step < 35; step++) {
        float[] k1 = uniform(rng, HKV * D), v1 = uniform(rng, HKV * D), q1 = uniform(rng, H * D);
        short[] k1b = bits(k1), v1b = bits(v1), q1b = bits(q1);
        cache.append(layer, new int[] {1}, k1b, v1b);
        keys.add(row(k1, 0, HKV * D));
        vals.add(row(v1, 0, HKV * D));
        short[] o = new short[H * D];
        cache.decode(layer, new int[] {1}, q1b, o);
        float[] got = new float[o.length];
        for (int i = 0; i < o.length; i++) {
          got[i] = Half.f16Float(o[i]);
        }
        worst = Math.max(worst, maxAbsDiff("decode f16", got, 0,
            attend(row(q1, 0, H * D), keys, vals, H, HKV, D)));
      }
      assertTrue(worst < 1e-3, "F16 worst error " + worst);
    }
  }

  /** fp16 bits of a; rounds a to the fp16 values in place so the reference sees them. */
  static short[] bits(float[] a) {
    short[] b = new short[a.length];
    for (int i = 0; i < a.length; i++) {
      b[i] = Half.f16Bits(a[i]);
      a[i] = Half.f16Float(b[i]);
    }
    return b;
  }

  static ByteBuffer direct(short[] a) {
    ByteBuffer b = ByteBuffer.allocateDirect(a.length * 2).order(ByteOrder.nativeOrder());
    b.asShortBuffer().put(a);
    return b;
  }

  // ---- compression -----------------------------------------------------------------------

  /** src/layout.h quantized_bytes: n quantized tokens (a multiple of G), all KV heads. */
  static long quantizedBytes(Config c, long n) {
    long elem = c.dtype().bytes(), d = c.headDim(), g = c.groupSize();
    long kRow = c.keyBits() == 16 ? d * elem : d * c.keyBits() / 8;
    long vRow = c.valueBits() == 16 ? d * elem : d * c.valueBits() / 8;
    long perGroup = g * (kRow + vRow);
    if (c.keyBits() != 16) {
      perGroup += 2 * d * elem; // per-channel scale/min of G tokens
    }
    if (c.valueBits() != 16) {
      perGroup += 2 * g * (d / g) * elem; // per-token scale/min of G channels
    }
    return n / g * perGroup * c.numKvHeads();
  }

  /** {used bytes, cached tokens} of one (sequence, layer) after prefill + steps appends. */
  static long[] expectedUsed(Config c, int prompt, int steps) {
    // UNIFORM budgets; the sinks take heavy-hitter slots (and fill them when they outnumber it);
    // WINDOW scores always keep the scoring window.
    long sinks = Math.min(c.sinkTokens(), prompt);
    long recent = budget(c.recentRatio(), prompt);
    if (c.scoreMode() == ScoreMode.WINDOW) recent = Math.max(recent, Math.min(c.windowSize(), prompt));
    long keep = Math.max(budget(c.heavyRatio(), prompt), sinks) + recent;
    keep = Math.min(keep, prompt);
    long g = c.groupSize(), r = c.residualLength();
    long f = flushSize(c); // a flush quantizes the oldest f of r
    long rest = keep - sinks;
    long quantized = rest - rest % g, residual = rest % g;
    for (int i = 0; i < steps; i++) {
      if (residual + 1 == r) {
        quantized += f;
        residual = r - f;
      } else {
        residual++;
      }
    }
    long denseBytes = (sinks + residual) * 2 * c.numKvHeads() * c.headDim() * c.dtype().bytes();
    return new long[] {quantizedBytes(c, quantized) + denseBytes, sinks + quantized + residual};
  }

  /**
   * F, the tokens one flush quantizes (flush_tokens in include/minikv.h): the whole residual
   * for 0, else flushTokens (unsigned) rounded up to a multiple of groupSize, at most
   * residualLength.
   */
  static long flushSize(Config c) {
    long g = c.groupSize(), r = c.residualLength(), f = Integer.toUnsignedLong(c.flushTokens());
    return f == 0 ? r : Math.min((f + g - 1) / g * g, r);
  }

  static long budget(double ratio, int prompt) {
    double x = ratio * prompt;
    return (long) Math.floor(x + 1e-9 * (1 + x));
  }

  static short[] normal16(Random rng, int n) {
    short[] a = new short[n];
    for (int i = 0; i < n; i++) {
      a[i] = Half.f16Bits((float) rng.nextGaussian());
    }
    return a;
  }

  /** The paper's setting: MHA, head_dim 128, 4096 prompt, 512 generated, 2-bit, G 16. */
  @Test
  void compressionPaperSetting() {
    Config cfg = Config.builder().preset(Preset.PAPER).backend(Backend.CPU).numLayers(1)
        .numHeads(1).numKvHeads(1).headDim(128).maxSeqLen(4096 + 512).build();
    assertEquals(2, cfg.keyBits());
    assertEquals(16, cfg.groupSize());
    assertEquals(Dtype.F16, cfg.dtype());
    try (KvCache cache = new KvCache(cfg)) {
      Random rng = new Random(3);
      int len = 4096, gen = 512;
      cache.prefill(0, new int[] {0}, new int[] {0, len}, normal16(rng, len * 128),
          normal16(rng, len * 128), normal16(rng, len * 128), new short[len * 128]);
      short[] out = new short[128];
      for (int i = 0; i < gen; i++) {
        cache.append(0, new int[] {0}, normal16(rng, 128), normal16(rng, 128));
        cache.decode(0, new int[] {0}, normal16(rng, 128), out);
      }
      MemoryStats st = cache.memoryStats();
      long[] want = expectedUsed(cfg, len, gen);
      long fp16 = (long) (len + gen) * 128 * 2 * 2;
      assertEquals(want[0], st.usedBytes());
      assertEquals(want[1], st.tokensCached());
      assertEquals(len + gen, st.tokensSeen());
      assertEquals(fp16, st.fp16EquivalentBytes());
      double ratio = 1 - (double) want[0] / fp16;
      assertEquals(ratio, st.compressionRatio(), 1e-12);
      assertEquals(0.8611, ratio, 5e-4, "MiniKV's ~86% compression");
      System.out.printf("compression %.4f%n", st.compressionRatio());
    }
  }

  /**
   * The default storage (BALANCED: 4-bit keys, 2-bit values, group 32, 4 sinks, a sliding
   * flush: flushTokens 32 of residualLength 64, the first flush at the residual's 64th token,
   * then one every 32, each quantizing the oldest 32 and keeping the newest 32 16-bit) on a
   * ragged batch: bytes follow the layout through several flushes. Uniform budgets, the ones
   * expectedUsed models (the default's pyramid gives each layer its own).
   */
  @Test
  void compressionRaggedDefaults() {
    Config cfg = raggedConfig().build();
    assertEquals(4, cfg.sinkTokens());
    assertEquals(64, cfg.residualLength());
    assertEquals(32, cfg.flushTokens());
    int steps = 100;
    checkRaggedCompression(cfg, steps);
    // The accounting checked differs from a whole flush's (flushTokens ignored) for some
    // sequence, so the check above tells them apart.
    Config whole = cfg.toBuilder().flushTokens(0).build();
    boolean differ = false;
    for (int len : RAGGED_LENS) {
      differ |= expectedUsed(cfg, len, steps)[0] != expectedUsed(whole, len, steps)[0];
    }
    assertTrue(differ, "the sliding and whole flushes give the same bytes");
  }

  /** The same storage flushing the whole residual at once (flushTokens 0), residual 32. */
  @Test
  void compressionWholeFlush() {
    checkRaggedCompression(raggedConfig().residualLength(32).flushTokens(0).build(), 45);
  }

  /**
   * Any flushTokens is valid: it is rounded up to a multiple of groupSize and capped at
   * residualLength. With groupSize 16 and residualLength 64, caches fed the same tokens give
   * the same decode outputs (bit for bit) and memory stats at every step when their
   * flushTokens round to the same F: 24 and 32; 1 and 16; 200, 2^32-1 (-1 as a Java int) and
   * 0 (the whole residual). The three F give different caches (so the comparisons can fail),
   * and each follows expectedUsed with the rounded F.
   */
  @Test
  void flushTokensRoundUpToWholeGroups() {
    Config base = raggedConfig().preset(Preset.PAPER).dtype(Dtype.F32).numLayers(1)
        .maxSequences(1).maxSeqLen(256).residualLength(64).build();
    assertEquals(16, base.groupSize());
    int[][] groups = {{24, 32}, {1, 16}, {200, -1, 0}};
    long[] rounded = {32, 16, 64};
    List<Config> cfgs = new ArrayList<>();
    List<KvCache> caches = new ArrayList<>();
    try {
      for (int g = 0; g < groups.length; g++) {
        for (int f : groups[g]) {
          Config c = base.toBuilder().flushTokens(f).build();
          assertEquals(rounded[g], flushSize(c), "flushTokens " + f);
          caches.add(new KvCache(c));
          cfgs.add(c);
        }
      }
      Random rng = new Random(6);
      int len = 40, w = 64;
      float[] q = uniform(rng, len * H * w), k = uniform(rng, len * HKV * w),
          v = uniform(rng, len * HKV * w);
      for (KvCache cache : caches) {
        cache.prefill(0, new int[] {0}, new int[] {0, len}, q, k, v, new float[len * H * w]);
      }
      int[] differ = new int[3]; // steps where groups (0, 1), (0, 2), (1, 2) differ in bytes
      for (int step = 1; step <= 160; step++) {
        float[] nk = uniform(rng, HKV * w), nv = uniform(rng, HKV * w), nq = uniform(rng, H * w);
        float[][] outs = new float[caches.size()][];
        long[] used = new long[caches.size()];
        for (int i = 0; i < caches.size(); i++) {
          KvCache cache = caches.get(i);
          cache.append(0, new int[] {0}, nk, nv);
          outs[i] = new float[H * w];
          cache.decode(0, new int[] {0}, nq, outs[i]);
          used[i] = cache.memoryStats().usedBytes();
          assertEquals(expectedUsed(cfgs.get(i), len, step)[0], used[i],
              "flushTokens " + cfgs.get(i).flushTokens() + ", step " + step);
        }
        int[] first = new int[groups.length];
        for (int g = 0, at = 0; g < groups.length; at += groups[g].length, g++) {
          first[g] = at;
          for (int i = at + 1; i < at + groups[g].length; i++) {
            String what = "flushTokens " + cfgs.get(i).flushTokens() + " vs "
                + cfgs.get(at).flushTokens() + ", step " + step;
            assertEquals(used[at], used[i], what);
            assertArrayEquals(outs[at], outs[i], what); // bit for bit (no NaN here)
          }
        }
        int[][] pairs = {{0, 1}, {0, 2}, {1, 2}};
        for (int p = 0; p < pairs.length; p++) {
          if (used[first[pairs[p][0]]] != used[first[pairs[p][1]]]) {
            differ[p]++;
          }
        }
      }
      for (int n : differ) {
        assertTrue(n > 20, "the rounded flushes differ too rarely: " + Arrays.toString(differ));
      }
    } finally {
      for (KvCache cache : caches) {
        cache.close();
      }
    }
  }

  static final int[] RAGGED_LENS = {100, 37, 258};

  /** The default storage on the CPU with uniform budgets and head_dim 64. */
  static Config.Builder raggedConfig() {
    return Config.builder().backend(Backend.CPU).numLayers(LAYERS).numHeads(H)
        .numKvHeads(HKV).headDim(64).maxSequences(3).maxSeqLen(512)
        .budgetPolicy(BudgetPolicy.UNIFORM);
  }

  /** A ragged batch of three prompts and {@code steps} appends; stats as expectedUsed says. */
  static void checkRaggedCompression(Config cfg, int steps) {
    try (KvCache cache = new KvCache(cfg)) {
      Random rng = new Random(4);
      int[] seqs = {2, 0, 1};
      int[] lens = RAGGED_LENS;
      int[] cu = {0, 100, 137, 395};
      for (int layer = 0; layer < LAYERS; layer++) {
        cache.prefill(layer, seqs, cu, normal16(rng, 395 * H * 64), normal16(rng, 395 * HKV * 64),
            normal16(rng, 395 * HKV * 64), new short[395 * H * 64]);
      }
      for (int i = 0; i < steps; i++) {
        for (int layer = 0; layer < LAYERS; layer++) {
          cache.append(layer, seqs, normal16(rng, 3 * HKV * 64), normal16(rng, 3 * HKV * 64));
          cache.decode(layer, seqs, normal16(rng, 3 * H * 64), new short[3 * H * 64]);
        }
      }
      long used = 0, cached = 0, seen = 0;
      for (int s = 0; s < seqs.length; s++) {
        long[] w = expectedUsed(cfg, lens[s], steps);
        used += w[0] * LAYERS;
        cached += w[1] * LAYERS;
        seen += (long) (lens[s] + steps) * LAYERS;
        assertEquals(w[1], cache.sequenceLength(seqs[s], 0).tokensCached());
      }
      MemoryStats st = cache.memoryStats();
      assertEquals(used, st.usedBytes());
      assertEquals(cached, st.tokensCached());
      assertEquals(seen, st.tokensSeen());
      assertEquals(1 - (double) used / (seen * HKV * 64 * 4), st.compressionRatio(), 1e-12);
    }
  }

  // ---- errors ----------------------------------------------------------------------------

  @Test
  void badConfigNamesTheField() {
    Object[][] cases = {
      {"num_heads (12) must be a multiple of num_kv_heads (8)",
          exact(Dtype.F32).toBuilder().numHeads(12).numKvHeads(8)},
      {"head_dim (20)", exact(Dtype.F32).toBuilder().headDim(20)},
      {"key_bits (3)", exact(Dtype.F32).toBuilder().keyBits(3)},
      {"group_size (24)", exact(Dtype.F32).toBuilder().groupSize(24)},
      {"heavy_ratio", exact(Dtype.F32).toBuilder().heavyRatio(1.5f)},
      {"num_layers (0)", exact(Dtype.F32).toBuilder().numLayers(0)},
    };
    for (Object[] c : cases) {
      Config cfg = ((Config.Builder) c[1]).build();
      MinikvException e = assertThrows(MinikvException.class, () -> new KvCache(cfg).close());
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertEquals(1, e.code());
      assertTrue(e.getMessage().contains((String) c[0]),
          "message '" + e.getMessage() + "' should name " + c[0]);
    }
  }

  /**
   * appendDecode equals append then decode bit for bit (quantized cache, GQA, flushes; float[]
   * for F32, direct buffers for F16), and a failing appendDecode appends nothing.
   */
  @Test
  void appendDecodeEqualsAppendThenDecode() {
    for (Dtype dtype : new Dtype[] {Dtype.F32, Dtype.F16}) {
      Config cfg = exact(dtype).toBuilder().preset(Preset.BALANCED).groupSize(16)
          .residualLength(16).build();
      try (KvCache fused = new KvCache(cfg); KvCache split = new KvCache(cfg)) {
        Random rng = new Random(9);
        int[] ids = {3, 1};
        int[] cu = {0, 60, 93};
        for (int layer = 0; layer < LAYERS; layer++) {
          float[] q = uniform(rng, 93 * H * D), k = uniform(rng, 93 * HKV * D),
              v = uniform(rng, 93 * HKV * D);
          for (KvCache c : new KvCache[] {fused, split}) {
            if (dtype == Dtype.F32) {
              c.prefill(layer, ids, cu, q, k, v, new float[93 * H * D]);
            } else {
              c.prefill(layer, ids, cu, bits(q), bits(k), bits(v), new short[93 * H * D]);
            }
          }
        }
        for (int step = 0; step < 40; step++) { // 40 > residualLength: flushes
          for (int layer = 0; layer < LAYERS; layer++) {
            float[] q = uniform(rng, 2 * H * D), k = uniform(rng, 2 * HKV * D),
                v = uniform(rng, 2 * HKV * D);
            String what = dtype + " step " + step + " layer " + layer;
            if (dtype == Dtype.F32) {
              float[] a = new float[2 * H * D], b = new float[2 * H * D];
              fused.appendDecode(layer, ids, q, k, v, a);
              split.append(layer, ids, k, v);
              split.decode(layer, ids, q, b);
              assertArrayEquals(b, a, what);
            } else {
              short[] qb = bits(q), kb = bits(k), vb = bits(v);
              ByteBuffer a = ByteBuffer.allocateDirect(2 * H * D * 2).order(ByteOrder.nativeOrder());
              short[] b = new short[2 * H * D];
              fused.appendDecode(layer, ids, direct(qb), direct(kb), direct(vb), a);
              split.append(layer, ids, kb, vb);
              split.decode(layer, ids, qb, b);
              short[] got = new short[b.length];
              a.asShortBuffer().get(got);
              assertArrayEquals(b, got, what);
            }
          }
        }
        SequenceLength before = fused.sequenceLength(1, 0);
        float[] q = uniform(rng, 2 * H * D), kv = uniform(rng, 2 * HKV * D);
        q[7] = Float.NaN;
        MinikvException e = assertThrows(MinikvException.class, () -> {
          if (dtype == Dtype.F32) {
            fused.appendDecode(0, ids, q, kv, kv, new float[2 * H * D]);
          } else {
            fused.appendDecode(0, ids, bits(q), bits(kv), bits(kv), new short[2 * H * D]);
          }
        });
        assertEquals(Status.INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("minikv_append_decode"), e.getMessage());
        assertEquals(before, fused.sequenceLength(1, 0), "a failed appendDecode appended");
      }
    }
  }

  @Test
  void libraryErrorsLeaveTheCacheUnchanged() {
    Config cfg = exact(Dtype.F32).toBuilder().maxTokens(32).build(); // two blocks
    try (KvCache cache = new KvCache(cfg)) {
      MinikvException e = assertThrows(MinikvException.class,
          () -> cache.decode(0, new int[] {0}, new float[H * D], new float[H * D]));
      assertEquals(Status.BAD_STATE, e.status());
      assertTrue(e.getMessage().contains("minikv_decode"), e.getMessage());

      int len = 100; // 6 blocks
      e = assertThrows(MinikvException.class, () -> cache.prefill(0, new int[] {1},
          new int[] {0, len}, new float[len * H * D], new float[len * HKV * D],
          new float[len * HKV * D], new float[len * H * D]));
      assertEquals(Status.CAPACITY_EXCEEDED, e.status());
      assertEquals(0, cache.memoryStats().tokensSeen());
      assertEquals(new SequenceLength(0, 0), cache.sequenceLength(1, 0));

      int small = 20;
      cache.prefill(0, new int[] {1}, new int[] {0, small}, new float[small * H * D],
          new float[small * HKV * D], new float[small * HKV * D], new float[small * H * D]);
      e = assertThrows(MinikvException.class, () -> cache.prefill(0, new int[] {1},
          new int[] {0, small}, new float[small * H * D], new float[small * HKV * D],
          new float[small * HKV * D], new float[small * H * D]));
      assertEquals(Status.BAD_STATE, e.status());
      assertTrue(e.getMessage().contains("already prefilled"), e.getMessage());

      e = assertThrows(MinikvException.class, () -> cache.release(99));
      assertEquals(Status.INVALID_ARGUMENT, e.status());
      assertTrue(e.getMessage().contains("seq_id (99)"), e.getMessage());
    }
  }

  @Test
  void bindingChecksArguments() {
    try (KvCache cache = new KvCache(exact(Dtype.F32))) {
      int n = H * D;
      Object[][] cases = {
        {"q has 3 elements", (Runnable) () -> cache.decode(0, new int[] {0}, new float[3], new float[n])},
        {"cuSeqlens has 1 entries", (Runnable) () -> cache.prefill(0, new int[] {0}, new int[] {0},
            new float[0], new float[0], new float[0], new float[0])},
        {"k has", (Runnable) () -> cache.append(0, new int[] {0, 1}, new float[HKV * D],
            new float[2 * HKV * D])},
        {"dtype is F32", (Runnable) () -> cache.decode(0, new int[] {0}, new short[n], new short[n])},
        {"not a direct ByteBuffer", (Runnable) () -> cache.decode(0, new int[] {0},
            ByteBuffer.allocate(n * 4), ByteBuffer.allocateDirect(n * 4))},
        {"read-only", (Runnable) () -> cache.decode(0, new int[] {0},
            ByteBuffer.allocateDirect(n * 4), ByteBuffer.allocateDirect(n * 4).asReadOnlyBuffer())},
        {"bytes remaining, want", (Runnable) () -> cache.decode(0, new int[] {0},
            ByteBuffer.allocateDirect(n * 4 + 1), ByteBuffer.allocateDirect(n * 4))},
      };
      for (Object[] c : cases) {
        MinikvException e = assertThrows(MinikvException.class, ((Runnable) c[1])::run);
        assertEquals(Status.INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains((String) c[0]), e.getMessage());
      }
      assertThrows(NullPointerException.class,
          () -> cache.decode(0, null, new float[n], new float[n]));
    }
    // The raw SWIG layer itself refuses a cu_seqlens of the wrong length (the library would
    // read n_seqs + 1 entries), and turns statuses into MinikvException inside the JNI call.
    ConfigStruct c = exact(Dtype.F32).toNative();
    CacheHandle h = MinikvNative.cache_create(c);
    try {
      IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
          () -> MinikvNative.prefill(h, 0, new int[] {0, 1}, new int[] {0, 1}, 1, 1, 1, 1, 0));
      assertTrue(e.getMessage().contains("cu_seqlens"), e.getMessage());
      assertThrows(NullPointerException.class,
          () -> MinikvNative.decode(h, 0, null, 1, 1, 0));
      MinikvException m = assertThrows(MinikvException.class,
          () -> MinikvNative.decode(h, 0, new int[] {0}, 0, 0, 0));
      assertEquals(Status.BAD_STATE, m.status()); // nothing prefilled
      assertTrue(m.getMessage().contains("minikv_decode"), m.getMessage());
    } finally {
      h.delete();
      c.delete();
    }
    c = exact(Dtype.F32).toBuilder().numKvHeads(3).build().toNative();
    try {
      ConfigStruct bad = c;
      MinikvException m = assertThrows(MinikvException.class, () -> MinikvNative.cache_create(bad));
      assertEquals(Status.INVALID_ARGUMENT, m.status());
    } finally {
      c.delete();
    }
    // AUTO resolves at creation: host arrays are accepted exactly when it resolved to CPU.
    try (KvCache auto = new KvCache(exact(Dtype.F32).toBuilder().backend(Backend.AUTO).build())) {
      MinikvException e = assertThrows(MinikvException.class,
          () -> auto.decode(0, new int[] {0}, new float[H * D], new float[H * D]));
      if (auto.backend() == Backend.CPU) { // the library answers: nothing prefilled
        assertEquals(Status.BAD_STATE, e.status(), e.getMessage());
      } else {
        assertEquals(Backend.CUDA, auto.backend());
        assertEquals(Status.INVALID_ARGUMENT, e.status());
        assertTrue(e.getMessage().contains("decodeDevice"), e.getMessage());
      }
    }
    try (KvCache cpu = new KvCache(exact(Dtype.F32))) {
      assertEquals(Backend.CPU, cpu.backend());
    }
  }

  @Test
  void useAfterClose() {
    KvCache cache = new KvCache(exact(Dtype.F32));
    cache.close();
    Runnable[] calls = {
      () -> cache.decode(0, new int[] {0}, new float[H * D], new float[H * D]),
      () -> cache.prefill(0, new int[] {0}, new int[] {0, 1}, new float[H * D],
          new float[HKV * D], new float[HKV * D], new float[H * D]),
      () -> cache.appendDevice(0, new int[] {0}, 0, 0, 0),
      () -> cache.release(0),
      cache::memoryStats,
      () -> cache.keptPositions(0, 0, 0),
      () -> cache.sequenceLength(0, 0),
    };
    for (Runnable call : calls) {
      MinikvException e = assertThrows(MinikvException.class, call::run);
      assertEquals(Status.BAD_STATE, e.status());
      assertTrue(e.getMessage().contains("closed"), e.getMessage());
    }
    assertDoesNotThrow(cache::close);
  }

  /** Each failure's message is its own, with many threads failing at once. */
  @Test
  void errorMessagesPerCall() throws Exception {
    ExecutorService pool = Executors.newFixedThreadPool(8);
    try {
      List<Future<?>> futures = new ArrayList<>();
      for (int g = 0; g < 16; g++) {
        final int id = g;
        futures.add(pool.submit(() -> {
          try (KvCache cache = new KvCache(exact(Dtype.F32))) {
            for (int i = 0; i < 200; i++) {
              int seq = 1000 + 16 * i + id;
              MinikvException e = assertThrows(MinikvException.class, () -> cache.release(seq));
              assertTrue(e.getMessage().contains("seq_id (" + seq + ")"), e.getMessage());
            }
          }
          return null;
        }));
      }
      for (Future<?> f : futures) {
        f.get();
      }
    } finally {
      pool.shutdown();
    }
  }

  @Test
  void statusesAndEnumsMatchTheLibrary() {
    for (Status s : Status.values()) {
      if (s == Status.UNKNOWN) {
        continue;
      }
      assertTrue(KvCache.statusString(s.code()).startsWith(s.cName() + ":"),
          s + " -> " + KvCache.statusString(s.code()));
      assertEquals(s, Status.fromCode(s.code()));
    }
    assertEquals(Status.UNKNOWN, Status.fromCode(99));
    assertEquals(minikv_backend.MINIKV_BACKEND_CUDA, Backend.CUDA.code);
    assertEquals(minikv_dtype.MINIKV_DTYPE_BF16, Dtype.BF16.code);
    assertEquals(minikv_dtype.MINIKV_DTYPE_F32, Dtype.F32.code);
    assertEquals(minikv_budget_policy.MINIKV_BUDGET_PYRAMID, BudgetPolicy.PYRAMID.code);
    assertEquals(minikv_score_mode.MINIKV_SCORE_WINDOW, ScoreMode.WINDOW.code);
    assertEquals(minikv_preset.MINIKV_PRESET_BALANCED, Preset.BALANCED.code);
    assertEquals(minikv_preset.MINIKV_PRESET_PAPER, Preset.PAPER.code);
    assertEquals(minikv_preset.MINIKV_PRESET_QUALITY, Preset.QUALITY.code);
    assertEquals(minikv_preset.MINIKV_PRESET_EVICTION_ONLY, Preset.EVICTION_ONLY.code);
    String v = KvCache.version();
    int n = KvCache.versionNumber();
    assertEquals(n / 10000 + "." + n / 100 % 100 + "." + n % 100, v);
  }

  @Test
  void configRoundTripsThroughC() {
    Config in = Config.builder().backend(Backend.CUDA).deviceId(3).dtype(Dtype.BF16)
        .numLayers(5).numHeads(12).numKvHeads(4).headDim(80).maxSequences(7).maxSeqLen(999)
        .maxTokens(12345).heavyRatio(0.125f).recentRatio(0.375f)
        .budgetPolicy(BudgetPolicy.PYRAMID).pyramidDepth(3.5f).scoreMode(ScoreMode.WINDOW)
        .windowSize(17).poolKernel(5).keyBits(4).valueBits(16).groupSize(32)
        .residualLength(64).sinkTokens(9).prefillStagingTokens(321).flushTokens(48).build();
    ConfigStruct c = in.toNative();
    try {
      assertTrue(c.getStruct_size() > 0);
      assertEquals(in.toString(), Config.fromNative(c).toString());
      Config back = Config.fromNative(c);
      assertEquals(in.maxTokens(), back.maxTokens());
      assertEquals(in.deviceId(), back.deviceId());
      assertEquals(in.pyramidDepth(), back.pyramidDepth());
      assertEquals(in.windowSize(), back.windowSize());
      assertEquals(in.poolKernel(), back.poolKernel());
      assertEquals(9, back.sinkTokens());
      assertEquals(321, back.prefillStagingTokens());
      assertEquals(48, c.getFlush_tokens());
      assertEquals(48, back.flushTokens());
    } finally {
      c.delete();
    }
    Config d = Config.builder().build();
    assertEquals(4, d.keyBits());
    assertEquals(2, d.valueBits());
    assertEquals(32, d.groupSize());
    assertEquals(4, d.sinkTokens());
    assertEquals(0, d.prefillStagingTokens());
    assertEquals(32, d.flushTokens()); // a sliding flush: the oldest 32 of 64 tokens
    assertEquals(64, d.residualLength());
    assertEquals(0.25f, d.heavyRatio());
    assertEquals(Backend.AUTO, d.backend());
    assertFalse(d.toString().isEmpty());
  }

  @Test
  void presetsSetTheCompressionFields() {
    // BALANCED flushes 32 tokens of a 64-token residual, the others the whole 128.
    Object[][] cases = {
      {Preset.BALANCED, 4, 2, 32, 4, BudgetPolicy.PYRAMID, ScoreMode.WINDOW, 64, 32},
      {Preset.PAPER, 2, 2, 16, 0, BudgetPolicy.PYRAMID, ScoreMode.CUMULATIVE, 128, 0},
      {Preset.QUALITY, 8, 8, 32, 4, BudgetPolicy.UNIFORM, ScoreMode.CUMULATIVE, 128, 0},
      {Preset.EVICTION_ONLY, 16, 16, 16, 0, BudgetPolicy.UNIFORM, ScoreMode.CUMULATIVE, 128, 0},
    };
    for (Object[] c : cases) {
      // Every compression field starts elsewhere than the preset puts it.
      ScoreMode other = c[6] == ScoreMode.WINDOW ? ScoreMode.CUMULATIVE : ScoreMode.WINDOW;
      Config cfg = Config.builder().backend(Backend.CPU).dtype(Dtype.BF16).numLayers(3)
          .numHeads(8).numKvHeads(2).headDim(96).maxSeqLen(777).heavyRatio(0.9f)
          .residualLength(512).flushTokens(96).scoreMode(other).preset((Preset) c[0]).build();
      String what = c[0].toString();
      assertEquals(c[1], cfg.keyBits(), what);
      assertEquals(c[2], cfg.valueBits(), what);
      assertEquals(c[3], cfg.groupSize(), what);
      assertEquals(c[4], cfg.sinkTokens(), what);
      assertEquals(c[5], cfg.budgetPolicy(), what);
      assertEquals(0.25f, cfg.heavyRatio(), what);
      assertEquals(0.25f, cfg.recentRatio(), what);
      assertEquals(c[7], cfg.residualLength(), what);
      assertEquals(c[8], cfg.flushTokens(), what);
      assertEquals(c[6], cfg.scoreMode(), what);
      // Everything else keeps the builder's values.
      assertEquals(Backend.CPU, cfg.backend(), what);
      assertEquals(Dtype.BF16, cfg.dtype(), what);
      assertEquals(3, cfg.numLayers(), what);
      assertEquals(96, cfg.headDim(), what);
      assertEquals(777, cfg.maxSeqLen(), what);
    }
    assertEquals(Config.builder().build().toString(),
        Config.builder().preset(Preset.BALANCED).build().toString(), "the default is BALANCED");
    assertThrows(NullPointerException.class, () -> Config.builder().preset(null));
  }

  /**
   * A prompt in chunks (prefillChunk) gives exactly one prefill's outputs and kept positions;
   * decode refuses the sequence mid-prompt; promptLens must match seqIds.
   */
  @Test
  void prefillChunkEqualsOneCall() {
    Config cfg = exact(Dtype.F32).toBuilder().numLayers(1).heavyRatio(0.25f).recentRatio(0.25f)
        .prefillStagingTokens(90).build();
    try (KvCache whole = new KvCache(cfg); KvCache chunked = new KvCache(cfg)) {
      Random rng = new Random(12);
      int len = 90;
      float[] q = uniform(rng, len * H * D), k = uniform(rng, len * HKV * D),
          v = uniform(rng, len * HKV * D), want = new float[len * H * D];
      whole.prefill(0, new int[] {3}, new int[] {0, len}, q, k, v, want);
      float[] got = new float[len * H * D];
      int[][] cuts = {{0, 17}, {17, 18}, {18, 90}};
      for (int[] cut : cuts) {
        int a = cut[0], b = cut[1];
        float[] out = new float[(b - a) * H * D];
        chunked.prefillChunk(0, new int[] {3}, new int[] {len}, new int[] {0, b - a},
            Arrays.copyOfRange(q, a * H * D, b * H * D), Arrays.copyOfRange(k, a * HKV * D, b * HKV * D),
            Arrays.copyOfRange(v, a * HKV * D, b * HKV * D), out);
        System.arraycopy(out, 0, got, a * H * D, out.length);
        if (b < len) {
          MinikvException e = assertThrows(MinikvException.class,
              () -> chunked.decode(0, new int[] {3}, new float[H * D], new float[H * D]));
          assertEquals(Status.BAD_STATE, e.status());
          assertTrue(e.getMessage().contains("mid-prompt"), e.getMessage());
        }
      }
      assertArrayEquals(want, got);
      for (int h = 0; h < HKV; h++) {
        assertArrayEquals(whole.keptPositions(3, 0, h), chunked.keptPositions(3, 0, h));
      }
      MinikvException e = assertThrows(MinikvException.class, () -> chunked.prefillChunk(0,
          new int[] {1}, new int[] {5, 5}, new int[] {0, 1}, new float[H * D],
          new float[HKV * D], new float[HKV * D], new float[H * D]));
      assertTrue(e.getMessage().contains("promptLens has 2 entries"), e.getMessage());
    }
  }

  /** Sinks are the first kept positions of every head, inside the budget. */
  @Test
  void sinkTokensAreKeptFirst() {
    Config cfg = exact(Dtype.F32).toBuilder().heavyRatio(0.25f).recentRatio(0.25f)
        .sinkTokens(6).build();
    try (KvCache cache = new KvCache(cfg)) {
      Random rng = new Random(8);
      int total = 83;
      cache.prefill(0, new int[] {0, 1}, new int[] {0, 80, 83}, uniform(rng, total * H * D),
          uniform(rng, total * HKV * D), uniform(rng, total * HKV * D), new float[total * H * D]);
      for (int h = 0; h < HKV; h++) {
        int[] kept = cache.keptPositions(0, 0, h);
        assertEquals(40, kept.length, "20 heavy-hitter slots (6 of them the sinks) + 20 recent");
        for (int i = 0; i < 6; i++) {
          assertEquals(i, kept[i]);
        }
        assertArrayEquals(new int[] {0, 1, 2}, cache.keptPositions(1, 0, h),
            "a prompt shorter than the sinks keeps all of it");
      }
      assertEquals(40, cache.sequenceLength(0, 0).tokensCached());
    }
  }

  @Test
  void versionRule() {
    int built = KvCache.BINDING_VERSION_NUMBER;
    int major = built / 10000;
    assertTrue(KvCache.compatible(built, built));
    assertTrue(KvCache.compatible(built, built + 1));
    assertTrue(KvCache.compatible(built, built + 100));
    assertTrue(KvCache.compatible(built, major * 10000 + 9999));
    assertFalse(KvCache.compatible(built, (major + 1) * 10000));
    assertFalse(KvCache.compatible(built, (major + 1) * 10000 + built % 10000));
    if (built % 10000 != 0) {
      assertFalse(KvCache.compatible(built, built - 1));
    }
    assertTrue(KvCache.compatible(built, KvCache.versionNumber()), KvCache.version());
  }

  /** The bulk converters are the scalar ones, element by element, and feed a 16-bit cache. */
  @Test
  void bulkHalfConversions() {
    Random rng = new Random(3);
    float[] src = new float[1009];
    float[] special = {
      0f, -0f, 1f, -2f, 65504f, 65520f, 1e-8f, Float.POSITIVE_INFINITY, Float.NaN
    };
    System.arraycopy(special, 0, src, 0, special.length);
    for (int i = special.length; i < src.length; i++) {
      src[i] = (float) (rng.nextGaussian() * Math.pow(2, rng.nextInt(40) - 20));
    }
    short[] f16 = Half.f16Bits(src);
    short[] bf16 = Half.bf16Bits(src);
    float[] back16 = Half.f16Floats(f16);
    float[] backBf = Half.bf16Floats(bf16);
    assertEquals(src.length, f16.length);
    assertEquals(src.length, backBf.length);
    for (int i = 0; i < src.length; i++) {
      assertEquals(Half.f16Bits(src[i]), f16[i], "f16 " + src[i]);
      assertEquals(Half.bf16Bits(src[i]), bf16[i], "bf16 " + src[i]);
      assertEquals(Float.floatToRawIntBits(Half.f16Float(f16[i])),
          Float.floatToRawIntBits(back16[i]));
      assertEquals(Float.floatToRawIntBits(Half.bf16Float(bf16[i])),
          Float.floatToRawIntBits(backBf[i]));
    }
    for (Dtype dtype : new Dtype[] {Dtype.F16, Dtype.BF16}) {
      int tokens = 8;
      float[] q = new float[tokens * 2 * 32];
      float[] k = new float[tokens * 32];
      float[] v = new float[tokens * 32];
      for (int i = 0; i < q.length; i++) {
        q[i] = (float) rng.nextGaussian();
      }
      for (int i = 0; i < k.length; i++) {
        k[i] = (float) rng.nextGaussian();
        v[i] = 0.75f; // attention of a constant is that constant
      }
      boolean isF16 = dtype == Dtype.F16;
      Config cfg = Config.builder().backend(Backend.CPU).dtype(dtype).numLayers(1).numHeads(2)
          .numKvHeads(1).headDim(32).build();
      try (KvCache cache = new KvCache(cfg)) {
        short[] out = new short[q.length];
        cache.prefill(0, new int[] {0}, new int[] {0, tokens},
            isF16 ? Half.f16Bits(q) : Half.bf16Bits(q), isF16 ? Half.f16Bits(k) : Half.bf16Bits(k),
            isF16 ? Half.f16Bits(v) : Half.bf16Bits(v), out);
        for (float x : isF16 ? Half.f16Floats(out) : Half.bf16Floats(out)) {
          assertEquals(0.75f, x, 0f, dtype.toString());
        }
      }
    }
  }

  @Test
  void halfConversions() {
    assertEquals((short) 0x3c00, Half.f16Bits(1f));
    assertEquals((short) 0xc000, Half.f16Bits(-2f));
    assertEquals((short) 0x7bff, Half.f16Bits(65504f));
    assertEquals((short) 0x7c00, Half.f16Bits(65520f));
    assertEquals((short) 0x2e66, Half.f16Bits(0.1f));
    assertEquals((short) 0x0001, Half.f16Bits(5.960464477539063e-08f));
    for (int h = 0; h < 1 << 16; h++) {
      float f = Half.f16Float((short) h);
      if (!Float.isNaN(f)) {
        assertEquals((short) h, Half.f16Bits(f), "f16 round trip " + h);
        // Java 17 has no Float.float16ToFloat; compare with a double computation instead.
        int e = (h >>> 10) & 0x1f, m = h & 0x3ff;
        double want = e == 0 ? m * Math.pow(2, -24) : e == 31 ? Double.POSITIVE_INFINITY
            : (1 + m / 1024.0) * Math.pow(2, e - 15);
        assertEquals((h & 0x8000) != 0 ? -want : want, f, 0.0);
      }
      if (((h >>> 7) & 0xff) != 0xff) {
        assertEquals((short) h, Half.bf16Bits(Half.bf16Float((short) h)), "bf16 " + h);
      }
    }
    assertEquals((short) 0x3f80, Half.bf16Bits(1.00390625f)); // tie → even
    assertEquals((short) 0x3f82, Half.bf16Bits(1.01171875f)); // tie → even (up)
  }

  /**
   * One KvCache used from two threads at once: its methods are synchronized, so each call
   * succeeds and sees the state before or after the other (the C library itself would fail
   * the overlapping call with MINIKV_ERR_BAD_STATE; the wrapper never lets that happen).
   */
  @Test
  void concurrentUseIsSerialized() throws Exception {
    final int l = 512;
    Config cfg = Config.builder().backend(Backend.CPU).dtype(Dtype.F32).numLayers(1)
        .numHeads(8).numKvHeads(2).headDim(64).maxSequences(1).maxSeqLen(l).build();
    Random rng = new Random(5);
    float[] q = new float[l * 8 * 64], k = new float[l * 2 * 64], v = new float[l * 2 * 64];
    for (float[] x : new float[][] {q, k, v}) {
      for (int i = 0; i < x.length; i++) {
        x[i] = (float) rng.nextGaussian();
      }
    }
    ExecutorService pool = Executors.newSingleThreadExecutor();
    try (KvCache cache = new KvCache(cfg)) {
      Future<?> prefills = pool.submit(() -> {
        float[] out = new float[l * 8 * 64];
        for (int i = 0; i < 4; i++) {
          cache.prefill(0, new int[] {0}, new int[] {0, l}, q, k, v, out);
          cache.release(0);
        }
        return null;
      });
      int queries = 0;
      while (!prefills.isDone()) {
        long seen = cache.sequenceLength(0, 0).tokensSeen();
        assertTrue(seen == 0 || seen == l, "seen " + seen);
        queries++;
      }
      prefills.get(); // rethrows a failure of the other thread
      assertTrue(queries > 0);
    } finally {
      pool.shutdown();
    }
  }
}
