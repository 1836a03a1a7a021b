#!/usr/bin/env python3
"""Tensor-parallel generation with the KV cache in libminikv: one process per device, the
model split by transformers' own tensor-parallel plan (q/k/v_proj column-wise: each rank
holds whole attention heads), one minikv.hf.MiniKVGenerator per rank caching its heads.

    # CPU, gloo (any machine; a tiny random LLaMA unless --model is given):
    torchrun --nproc-per-node 2 examples/python/tp_generate.py --device cpu
    # two GPUs, NCCL (NVLink multicast stays off: NCCL_NVLS_ENABLE=0):
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 examples/python/tp_generate.py \\
        --device cuda --model /path/to/llama --dtype bfloat16

Every rank runs the same calls on the same prompts (random token ids, the same on every
rank); rank 0 prints each rank's heads and memory, the generated tokens and tokens/s. The
world size must divide the model's KV heads (minikv.hf.tensor_parallel_heads says so
before the model is loaded). Needs torch, transformers >= 5 and accelerate; with
MINIKV_LIBRARY pointing at a CUDA build of libminikv for --device cuda.
"""
import argparse
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "python"))

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--device", choices=("cpu", "cuda"), default=None,
               help="cpu: gloo, cuda: one GPU per rank and NCCL (default: cuda when there is one)")
p.add_argument("--model", help="a transformers LLaMA-family checkpoint directory "
                               "(default: a tiny random LLaMA, 8 heads / 4 KV heads)")
p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
               help="default: float32 on the CPU, bfloat16 on CUDA")
p.add_argument("--batch", type=int, default=4)
p.add_argument("--prompt-tokens", type=int, default=256)
p.add_argument("--new-tokens", type=int, default=32)
p.add_argument("--preset", default=None, help="a minikv.Preset name (default: the library's)")
args = p.parse_args()

if args.device == "cpu":  # transformers puts a tensor-parallel model on the accelerator if any
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (SHARP) in NCCL

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import minikv  # noqa: E402
import minikv.hf  # noqa: E402

cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
if cuda and not torch.cuda.is_available():
    sys.exit("--device cuda: torch sees no GPU")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if cuda:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))

path = args.model
if path is None:  # rank 0 writes a tiny random checkpoint that every rank then loads
    path = os.path.join(tempfile.gettempdir(), "minikv-tp-tiny-llama")
    if rank == 0 and not os.path.exists(os.path.join(path, "model.safetensors")):
        cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                       num_hidden_layers=4, num_attention_heads=8,
                                       num_key_value_heads=4, head_dim=32)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    dist.barrier()
config = transformers.AutoConfig.from_pretrained(path)
heads, kv_heads = minikv.hf.tensor_parallel_heads(config, world)  # refuses a bad world size
model = transformers.AutoModelForCausalLM.from_pretrained(
    path, distributed_config=transformers.DistributedConfig(tp_plan="auto"), dtype=dtype).eval()

vocab = config.get_text_config().vocab_size
prompts = torch.randint(0, vocab, (args.batch, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(1))  # the same on every rank
extra = {} if args.preset is None else {"preset": args.preset}
with minikv.hf.MiniKVGenerator(model, max_sequences=args.batch,
                               max_seq_len=args.prompt_tokens + args.new_tokens, **extra) as gen:
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    logits = gen.prefill(prompts)
    nxt = logits.argmax(-1)
    out = [nxt]
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(args.new_tokens - 1):
        nxt = gen.step(nxt).argmax(-1)
        out.append(nxt)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    st = gen.memory_stats()
    report = dict(rank=rank, heads=(gen.config.num_heads, gen.config.num_kv_heads),
                  kv_heads=(gen.kv_head_offset, gen.kv_head_offset + gen.config.num_kv_heads),
                  pool=st.pool_bytes, used=st.used_bytes, workspace=st.workspace_bytes,
                  ratio=st.compression_ratio, backend=str(gen.cache.backend),
                  # CUDA: torch's peak on this GPU plus libminikv's own cudaMalloc'd pool;
                  # CPU: the process's peak resident memory (everything, the pool included).
                  peak=(torch.cuda.max_memory_allocated() + st.pool_bytes + st.workspace_bytes
                        if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
                  prefill_s=t1 - t0, decode_s=t2 - t1)

reports = [None] * world
dist.all_gather_object(reports, report)
if rank == 0:
    MiB = 1 << 20
    print(f"{type(model).__name__} from {path}: {config.num_attention_heads} heads / "
          f"{config.num_key_value_heads} KV heads over {world} ranks ({heads} / {kv_heads} each), "
          f"{dtype}, {'NCCL + CUDA' if cuda else 'gloo + CPU'}, libminikv {minikv.library_version()}")
    for r in reports:
        print(f"  rank {r['rank']}: {r['backend']} cache of KV heads [{r['kv_heads'][0]}, "
              f"{r['kv_heads'][1]}), pool {r['pool'] / MiB:.1f} MiB, used {r['used'] / MiB:.2f} MiB "
              f"(compression {r['ratio']:.3f}), {'peak GPU' if cuda else 'peak RSS'} "
              f"{r['peak'] / MiB:.0f} MiB")
    slowest = max(reports, key=lambda r: r["prefill_s"] + r["decode_s"])
    n = args.batch * args.new_tokens
    print(f"  batch {args.batch}, prompt {args.prompt_tokens}, {args.new_tokens} new tokens: prefill "
          f"{slowest['prefill_s']:.2f} s, decode {args.batch * (args.new_tokens - 1) / slowest['decode_s']:.1f} "
          f"tokens/s, end to end {n / (slowest['prefill_s'] + slowest['decode_s']):.1f} tokens/s")
    print("  sequence 0:", torch.stack(out, 1)[0].tolist())
# Every rank past its last collective before any tears gloo down: a rank that destroys its
# process group while a peer's gloo threads still talk to it can abort at exit.
dist.barrier()
dist.destroy_process_group()
# Then leave without the interpreter's teardown: with the barrier and the destroy, a gloo
# rank still aborted there now and then ("terminate called without an active exception",
# after every output was written; pytorch/pytorch#179291 describes gloo threads that hold
# Python objects into finalization). The cache was closed with its `with` block above.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
