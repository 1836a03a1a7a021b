#!/usr/bin/env python3
"""Writes the designed seed inputs of the fuzz corpus (tests/fuzz/corpus/<target>/seed-*).

The encoders mirror the decoders in fuzz_api_sequence.cpp (decode_config, Harness::op_*)
and fuzz_config.cpp byte for byte, so each seed drives a known scenario: a generation loop
through residual flushes, a tight block pool, release and reuse, keep-everything 16-bit
storage, SnapKV window + pyramid budgets, extreme values, every fault kind, corrupted
configurations. The rest of the corpus (min-*) is what libFuzzer found: a set cover of the
coverage edges reached (tests/fuzz/select_corpus.py; scripts/reliability.sh FUZZ_MERGE=1
refreshes it).

    python3 tests/fuzz/make_corpus.py            # rewrite the seed-* files
    FUZZ_TRACE=1 build/tests/fuzz/fuzz_api_sequence_replay tests/fuzz/corpus/fuzz_api_sequence/seed-01-generate
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
F32, F16, BF16 = 0, 1, 2
DIMS = [16, 32, 48, 64]
BITS = [2, 4, 16, 8]
SINKS = [0, 1, 4, 17]


def search(pred):
    for b in range(256):
        if pred(b):
            return b
    raise ValueError("no byte encodes the requested value")


class Seq:
    """Encoder for fuzz_api_sequence inputs."""

    def __init__(self, dtype=F16, extreme=False, pyramid=False, window=False, layers=2, kv=2, rep=2,
                 head_dim=32, group=16, r_mult=2, seqs=3, max_seq_len=96, max_tokens=0, heavy=2,
                 recent=2, key_bits=2, value_bits=2, window_size=8, pool_kernel=3, depth=7, seed=1,
                 sinks=0, staging=0):
        # staging: prefill_staging_tokens in halves of max_seq_len: 0, 1, 2 or 4.
        # heavy/recent are in eighths (ratio = x / 8).
        self.S, self.L, self.max_seq_len = seqs, layers, max_seq_len
        b = bytearray()
        b.append(dtype | (extreme << 2) | (pyramid << 3) | (window << 4))
        b.append(search(lambda x: x % 3 == layers - 1 and (x >> 2) % 2 == kv - 1 and (x >> 3) % 3 == rep - 1))
        g = group if head_dim % group == 0 else 16
        b.append(search(lambda x: (32 if x & 1 else 16) == group and DIMS[(x >> 1) & 3] == head_dim
                        and 1 + (x >> 3) % 4 == r_mult))
        assert g == group
        b.append(seqs - 1)
        b.append(max_seq_len - 1)
        assert max_tokens == 0 or (max_tokens % 4 != 0 and max_tokens < 256)
        b.append(max_tokens)
        b.append(search(lambda x: x % 9 == heavy and (x // 9) % 9 == recent))
        b.append(search(lambda x: BITS[x % 4] == key_bits and BITS[(x // 4) % 4] == value_bits))
        b.append(search(lambda x: 1 + x % 16 == window_size and 1 + 2 * ((x >> 4) % 4) == pool_kernel
                        and SINKS[x >> 6] == sinks))
        b.append((depth - 1) | ([0, 1, 2, 4].index(staging) << 3))
        self.b = b
        self.pending = {}  # (seq, layer) -> [prompt length, positions received]
        self.no_corruption()
        self.b += struct.pack("<Q", seed)

    def no_corruption(self):
        self.b.append(0)

    def u32(self, x):
        self.b += struct.pack("<I", x)

    def pick(self, ids):
        """Bytes of pick_ids' Fisher-Yates (below(i) for i = S..2) whose order starts with ids."""
        import itertools
        for choice in itertools.product(*[range(i) for i in range(self.S, 1, -1)]):
            order = list(range(self.S))
            for i, j in zip(range(self.S, 1, -1), choice):
                order[i - 1], order[j] = order[j], order[i - 1]
            if order[:len(ids)] == list(ids):
                return bytes(choice)
        raise ValueError("ids not reachable")

    def prefill(self, ids, layer, lens, fault=0, data=7, extra=b""):
        self.b.append(0)  # op: prefill
        self.b.append(0 if fault == 0 else search(lambda v: v >= 160 and 1 + v % 14 == fault))
        self.b.append(len(ids) - 1)
        self.b.append(layer)
        self.b += self.pick(ids)
        for ln in lens:
            if ln == self.max_seq_len:
                self.b.append(0)
            else:
                self.b.append(1)
                self.b.append(ln - 1)
        self.u32(data)
        self.b += extra

    def prefill_all_layers(self, seq, length, data=11):
        self.b.append(7)
        self.b += self.pick([seq])
        self.b.append(length - 1)
        self.u32(data)

    def append(self, layer, ids, fault=0, data=5, extra=b""):
        self.b.append(2)
        self.b.append(0 if fault == 0 else search(lambda v: v >= 176 and 1 + v % 10 == fault))
        self.b.append(layer)
        self.b.append(len(ids) - 1)
        self.b += self.pick(ids)
        self.b.append(0)  # exactly these ids (no preference for prefilled ones)
        self.u32(data)  # read before the fault's own bytes
        self.b += extra

    def decode(self, layer, ids, fault=0, data=9, extra=b""):
        self.b.append(3)
        self.b.append(0 if fault == 0 else search(lambda v: v >= 176 and 1 + v % 10 == fault))
        self.b.append(layer)
        self.b.append(len(ids) - 1)
        self.b += self.pick(ids)
        self.b.append(0)
        self.b += extra
        self.u32(data)

    def release(self, seq, invalid=False):
        self.b.append(4)
        self.b.append(201 if invalid else 0)
        self.b.append(seq)

    def query(self, kind, seq=0, layer=0, extra=b""):
        self.b.append(5)
        self.b += bytes([1, seq, 1, layer, kind])
        self.b += extra

    def null_handle(self, which):
        self.b.append(6)
        self.b.append(which)

    def prefill_chunk(self, ids, layer, chunks, fault=0, at=0, extra=b"", data=13, ok=True):
        """chunks: (prompt length, chunk length) per id. A sequence mid-prompt in the model
        continues its prompt (the length must match); ok: the call is meant to succeed (the
        model of prompts mid-way follows it)."""
        self.b.append(9)
        self.b.append(0 if fault == 0 else search(lambda v: v >= 160 and 1 + v % 18 == fault))
        self.b.append(len(ids) - 1)
        self.b.append(layer)
        self.b += self.pick(ids)
        for seq, (plen, clen) in zip(ids, chunks):
            got = self.pending.get((seq, layer))
            if got:
                assert got[0] == plen and clen <= got[0] - got[1]
                self.b.append(clen - 1)
            else:
                self.b.append(plen - 1)
                if clen == plen:
                    self.b.append(0)
                else:
                    self.b += bytes([1, clen - 1])
        if fault >= 7:
            self.b.append(at)
            self.b += extra
        self.u32(data)
        if ok:
            for seq, (plen, clen) in zip(ids, chunks):
                p = self.pending.setdefault((seq, layer), [plen, 0])
                p[1] += clen
                if p[1] == plen:
                    del self.pending[(seq, layer)]

    def release_pending(self, seq):
        for key in [k for k in self.pending if k[0] == seq]:
            del self.pending[key]

    def generate(self, steps, data=3):
        self.b.append(8)
        self.b.append(steps - 1)
        self.u32(data)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


def api_seeds():
    # 1. The engine's loop: a batch in both layers, a third prompt in every layer, 40
    #    generation steps (flushes at R = 32), release and reuse of a slot.
    s = Seq(dtype=F16, seqs=3, max_seq_len=96, r_mult=2)
    s.prefill([0, 1], 0, [33, 17])
    s.prefill([1, 0], 1, [17, 33])
    s.prefill_all_layers(2, 60)
    s.generate(40)
    s.decode(0, [2, 0, 1])
    s.release(1)
    s.prefill([1], 0, [50])
    s.prefill([1], 1, [50])
    s.generate(20)
    write("fuzz_api_sequence", "seed-01-generate", s.b)

    # 2. A tight pool: 7 blocks of 16 tokens; prefills and flushes run out, release, retry.
    s = Seq(dtype=F32, seqs=4, max_seq_len=96, r_mult=1, max_tokens=99, heavy=3, recent=3, layers=1)
    s.prefill([0, 1], 0, [64, 40])  # 3 + 1 blocks
    s.prefill([2, 3], 0, [96, 96])  # 4 + 4 more: CAPACITY_EXCEEDED
    s.prefill([2], 0, [30])         # 1 block
    s.generate(60)                  # flushes every 16 steps until the pool is full
    s.release(0)
    s.prefill([0], 0, [96])
    s.generate(30)
    write("fuzz_api_sequence", "seed-02-pool-pressure", s.b)

    # 3. Keep everything, 16-bit storage: decode is exact attention over every token.
    s = Seq(dtype=BF16, key_bits=16, value_bits=16, heavy=4, recent=4, seqs=2, max_seq_len=64)
    s.prefill([0, 1], 0, [64, 31])
    s.prefill([0, 1], 1, [5, 1])
    s.generate(35)
    write("fuzz_api_sequence", "seed-03-keep-all-16bit", s.b)

    # 4. SnapKV window scores with max-pooling, pyramid budgets over 3 layers, 4-bit keys.
    s = Seq(dtype=F16, window=True, pyramid=True, layers=3, kv=1, rep=3, head_dim=64, group=32,
            r_mult=1, key_bits=4, value_bits=2, window_size=5, pool_kernel=7, depth=3,
            max_seq_len=96, seqs=2)
    s.prefill_all_layers(0, 60)
    s.prefill([1], 2, [70])
    s.generate(40)
    write("fuzz_api_sequence", "seed-04-window-pyramid", s.b)

    # 5. Extreme values (Inf, NaN, 65504, subnormals) through prefill, flushes and decode.
    s = Seq(dtype=F16, extreme=True, seqs=2, r_mult=1, max_seq_len=80)
    s.prefill([0, 1], 0, [70, 20])
    s.prefill([0, 1], 1, [3, 80])
    s.generate(40)
    write("fuzz_api_sequence", "seed-05-extreme-values", s.b)

    # 6. Every fault kind of prefill/append/decode, between valid calls.
    s = Seq(dtype=F32, seqs=3, max_seq_len=48, r_mult=1)
    s.prefill([0, 1], 0, [20, 30])
    # The bytes each fault kind reads (corrupt_batch, then the call's own kinds).
    # (C++17 evaluates the right side of an assignment first: fault 4 reads its value,
    # then the index.)
    batch = {1: b"", 2: b"\x01", 3: b"\x00", 4: b"\x01\x00", 5: b"\x01", 6: b""}
    prefill_extra = {**batch, 7: b"", 8: b"\x02", 9: b"", 10: b"\x01", 11: b"\x00",
                     12: b"\x01\x02", 13: b"\x00\x01"}
    call_extra = {**batch, 7: b"", 8: b"", 9: b""}
    for fault in range(1, 14):
        s.prefill([2, 0], 1, [10, 12], fault=fault, extra=prefill_extra[fault])
    for fault in range(1, 10):
        s.append(0, [0, 1], fault=fault, extra=call_extra[fault])
        s.decode(0, [1, 0], fault=fault, extra=call_extra[fault])
    s.append(1, [0])  # layer 1 not prefilled for 0: BAD_STATE
    s.decode(0, [2])  # nor layer 0 for 2
    s.release(0, invalid=True)
    s.generate(5)
    write("fuzz_api_sequence", "seed-06-faults", s.b)

    # 7. Queries with odd arguments and NULL handles.
    s = Seq(dtype=F16, seqs=2, max_seq_len=40, r_mult=1)
    s.prefill([0], 0, [40])
    for mode in range(4):
        s.query(0, extra=bytes([mode]))
    for cap, mode in [(0, 1), (0, 2), (5, 0), (39, 0), (43, 3), (7, 1)]:
        s.query(1, extra=bytes([1, 0, cap, mode]))
    s.query(1, seq=1, extra=bytes([1, 0, 3, 0]))  # not prefilled: BAD_STATE
    for size_idx in range(5):
        s.query(2, extra=bytes([size_idx, 1]))
    s.query(2, extra=bytes([3, 0]))  # NULL out
    for which in range(8):
        s.null_handle(which)
    write("fuzz_api_sequence", "seed-07-queries", s.b)

    # 8. max_seq_len reached by generation (CAPACITY_EXCEEDED without pool pressure).
    s = Seq(dtype=F32, seqs=2, max_seq_len=20, r_mult=1, layers=1)
    s.prefill([0, 1], 0, [19, 20])
    s.generate(5)
    s.append(0, [0])
    write("fuzz_api_sequence", "seed-08-max-seq-len", s.b)

    # 9. Corrupted configurations handed to create (then the valid one runs).
    for field in range(24):
        s = Seq(dtype=F16, seqs=2, max_seq_len=32)
        s.b[10] = 230  # corrupted_create: field index, value, tail flag, then the seed
        base = s.b[:11]
        value = [0, 2, 0xFFFFFFFF, 9, 0, 7, 3, 40, 0, 0, 5, 0x7FC00000, 0x40000000, 4, 0x3F000000,
                 2, 0, 4, 3, 8, 24, 48, 65, 1][field]
        if field == 0:  # struct_size: a u32 (unused), then below(sizeof + 65)
            body = bytes([0]) + struct.pack("<I", 0) + bytes([90])
        elif field in (4, 5, 6, 7, 8, 9, 10, 16, 21, 22):  # sizes: u16 % 2048
            body = bytes([field]) + struct.pack("<H", value)
        else:
            body = bytes([field]) + struct.pack("<I", value)
        body += bytes([1, 3])  # a non-zero byte at sizeof + 3
        s.b = bytearray(base) + body + struct.pack("<Q", 1)
        s.prefill([0], 0, [30])
        s.generate(3)
        write("fuzz_api_sequence", "seed-09-create-field-%02d" % field, s.b)

    # 10. Attention sinks (17: more than some prompts hold) with 8-bit keys, 4-bit values.
    s = Seq(dtype=BF16, seqs=3, max_seq_len=90, r_mult=1, key_bits=8, value_bits=4, sinks=17)
    s.prefill([0, 1, 2], 0, [90, 12, 17])
    s.prefill([2, 1], 1, [40, 3])
    s.generate(30)
    write("fuzz_api_sequence", "seed-10-sinks-8bit", s.b)

    # 11. Chunked prefill: prompts in chunks through both layers, mixed with whole prompts;
    #     decode mid-prompt (BAD_STATE); a full staging area (CAPACITY_EXCEEDED); an
    #     abandoned prompt; every fault of prefill_chunk's own; then generation.
    s = Seq(dtype=F16, seqs=3, max_seq_len=64, r_mult=1, staging=2)  # 64 staging rows
    for layer in (0, 1):
        s.prefill_chunk([0, 1], layer, [(50, 20), (30, 30)])
    s.decode(0, [0])                                                   # mid-prompt
    s.prefill_chunk([2], 0, [(40, 5)], ok=False)                       # 50 + 40 > 64 rows
    s.prefill([0], 0, [10])                                            # minikv_prefill: BAD_STATE
    for fault, extra in [(12, b""), (13, b"\x01"), (14, b"\x01"), (15, b""), (10, b""), (7, b"")]:
        s.prefill_chunk([0], 0, [(50, 7)], fault=fault, extra=extra, ok=False)
    s.prefill_chunk([0], 0, [(50, 1)])
    s.prefill_chunk([0], 0, [(50, 29)])                                # done in layer 0
    s.prefill_chunk([2, 0], 1, [(14, 3), (50, 30)])                    # first chunk + last
    s.release(2)                                                       # abandoned mid-prompt
    s.release_pending(2)
    s.prefill_chunk([2], 0, [(64, 1)])
    s.prefill_chunk([2], 0, [(64, 63)])
    s.generate(20)
    write("fuzz_api_sequence", "seed-11-chunked-prefill", s.b)


def config_seeds():
    # mode byte: bit0 raw bytes, bits1-2 struct_size kind, bit3 non-zero tail byte.
    write("fuzz_config", "seed-01-defaults", bytes([0, 1, 1, 1, 1, 0, 64, 0, 0]))
    write("fuzz_config", "seed-02-gqa", bytes([0, 3, 1, 3, 7, 3, 0, 4, 0]))
    write("fuzz_config", "seed-03-short-struct", bytes([2, 1, 1, 1, 1, 0, 64, 0, 0, 40]))
    write("fuzz_config", "seed-04-long-struct-zero-tail", bytes([4, 1, 1, 1, 1, 0, 64, 0, 0, 20]))
    write("fuzz_config", "seed-05-long-struct-tail-set", bytes([12, 1, 1, 1, 1, 0, 64, 0, 0, 20, 5, 9]))
    write("fuzz_config", "seed-06-raw-zero", bytes([1]) + bytes(100))
    # Defaults with two fields overwritten by raw values (offset index, value).
    write("fuzz_config", "seed-07-huge-seq-len",
          bytes([0, 1, 1, 1, 1, 0, 64, 0, 1, 9]) + struct.pack("<I", 1 << 30))
    write("fuzz_config", "seed-08-huge-sequences",
          bytes([0, 1, 1, 1, 1, 0, 64, 0, 2, 8]) + struct.pack("<I", 1 << 20) + bytes([10]) +
          struct.pack("<I", 1 << 31))
    write("fuzz_config", "seed-09-cuda-backend", bytes([0, 1, 1, 1, 1, 0, 64, 0, 1, 1]) + struct.pack("<I", 2))
    write("fuzz_config", "seed-10-bad-enum", bytes([0, 1, 1, 1, 1, 0, 64, 0, 1, 3]) + struct.pack("<I", 0xCAFEBABE))


if __name__ == "__main__":
    api_seeds()
    config_seeds()
