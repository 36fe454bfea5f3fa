"""A torch-free engine core's model step, prototyped (issue 41, memory): the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF) prefilled and greedily decoded on treadle's C kernels with
numpy and ctypes only, to measure what such a process holds and to check its tokens against
treadle's own.

What it does, as the engine core does on the default path (`model/fused_decode.py`,
`model/quantized.py`, `model/linear_method.py`, `model/layers.py`):

- reads the GGUF with `treadle.model.gguf_file` (numpy), un-permutes the q/k rows as
  `gguf_layout.unpermute_rope_rows` (the loader's) does, stacks q, k, v and gate, up as the fused layers hold
  them, and lays every linear weight and the (tied) embedding out 16 outputs wide
  (`gguf_layout.tile_layout` then `g16_layout`, the numpy layouts `QuantizedWeight` wraps);
- builds (or finds in the cache) the kernels' library with `treadle.model.kernel_build`;
- prefills the prompt through `decode_layers_f32` in chunks of at most 64 rows (the GGUF
  kernels' row limit, `GGUF_MAX_ROWS`), each row with its own context length, then decodes
  one token a step through the same call, int8x2 activations (`int8_activations=2`), a
  float32 paged KV cache of blocks of 16;
- the embedding rows with `gguf_dequantize_rows_f32`, the LM head with `gguf_linear_i8x2`
  on the embedding's 16-wide blocks, argmax with numpy.

Run: `python benchmarks/torchless_decode.py` (compares with treadle, run offline in a
subprocess with TREADLE_ENABLE_MULTIPROCESSING=0); `--no-reference` skips that.
The prototype's process never imports torch: it checks `'torch' not in sys.modules` at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from treadle.model import kernel_lib
from treadle.model.gguf_layout import (
    KIND_Q4_G16,
    GGUFBlocks,
    g16_layout,
    tile_layout,
    unpermute_rope_rows,
)
from treadle.model.kernel_lib import DecodeLayer, DecodeModel

# Fixed prompt: treadle's tokenizer (`treadle.tokenizer.load_tokenizer`) on the default model,
# for the text below, taken once (79 tokens: prefill chunks of 64 and 15).
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from Mainz, combined movable metal type, oil-based ink and a screw "
    "press adapted from wine making. Within fifty years, presses were running in more than two "
    "hundred European cities, and millions of books had been printed. Historians still argue "
    "about how quickly this changed ordinary life, but most agree that"
)
PROMPT_IDS = [
    504, 1463, 282, 260, 7510, 1757, 5634, 281, 260, 35561, 2070, 28, 645, 28322, 45382, 28,
    253, 4231, 45956, 429, 6586, 106, 28, 5276, 39245, 4718, 1502, 28, 2664, 29, 2542, 12923,
    284, 253, 21665, 1757, 9309, 429, 8289, 1625, 30, 10043, 13869, 929, 28, 32422, 592, 4108,
    281, 540, 670, 827, 3822, 3284, 4199, 28, 284, 5711, 282, 2905, 761, 719, 8057, 30, 41396,
    1361, 7440, 563, 638, 3112, 451, 4247, 8207, 1029, 28, 564, 768, 3387, 338,
]  # fmt: skip
MAX_ROWS = 64  # rows per decode_layers_f32 call (GGUF_MAX_ROWS: the fused path's limit)
BLOCK_SIZE = 16  # KV cache block (CacheConfig.block_size)


def memory(label: str) -> dict[str, float]:
    """This process's RSS, PSS (and their parts) in MiB, from /proc/self/smaps_rollup."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            fields[name] = int(parts[0]) / 1024
    keep = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous")
    row = {k: round(fields[k], 1) for k in keep if k in fields}
    print(f"memory {label}: " + ", ".join(f"{k} {v} MiB" for k, v in row.items()), flush=True)
    return row


# -- the kernels' library: `treadle.model.kernel_lib` (cpu_kernels.py's torch-free part) -----


def load_kernels(isa: str) -> ctypes.CDLL:
    """The level's library (built into the cache on first use), each kernel typed."""
    from treadle.model.kernel_build import build  # torch-free (treadle.envs, logger)
    from treadle.model.kernel_lib import open_library

    return open_library(isa, build(isa))


# -- weights: GGUF blocks laid out 16 outputs wide (QuantizedWeight.build + to_g16) ----------


def g16(parts: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, int, int, int]:
    """(layout, kernel kind, out_features, in_features) of the parts' rows stacked and laid
    out 16 outputs wide: `gguf_layout`'s tiles, then its 16-wide layout in their memory (the
    bytes `QuantizedWeight.build(...).to_g16()` makes for the engine core)."""
    rows = sum(raw.shape[0] for _, raw in parts)
    laid = tile_layout([GGUFBlocks(kind, raw) for kind, raw in parts], rows)
    assert laid is not None, [kind for kind, _ in parts]
    tiles, kind, in_features = laid
    return g16_layout(tiles, kind, in_place=True), kind + KIND_Q4_G16, rows, in_features


class TorchlessModel:
    """The default model's weights, KV cache and decode call, numpy and ctypes only."""

    def __init__(self, path: str, lib: ctypes.CDLL, num_threads: int, max_len: int) -> None:
        from treadle.model.arch import ModelArch  # torch-free
        from treadle.model.gguf_file import GGUFFile  # torch-free (numpy)

        self.lib, self.num_threads = lib, num_threads
        gguf = GGUFFile(path)
        t = {x.name: x for x in gguf.tensors}
        arch = ModelArch.from_gguf_fields(gguf.fields, set(t))
        assert arch.family in ("llama", "mistral") and not arch.qk_norm and not arch.qkv_bias
        assert arch.tie_word_embeddings and arch.rope_scaling is None
        self.arch = arch
        h, d, nl = arch.hidden_size, arch.head_dim, arch.num_layers
        g16_kinds = lib.gguf_g16_kinds()

        def f32(name: str) -> np.ndarray:
            return np.ascontiguousarray(t[name].dequantize(), dtype=np.float32)

        def weight(*names: str, heads: tuple[int, ...] = ()) -> tuple[np.ndarray, int]:
            parts = []
            for i, name in enumerate(names):
                raw = t[name].data
                if heads and heads[i]:
                    raw = unpermute_rope_rows(raw, heads[i])
                parts.append((t[name].kind, raw))
            out, kind, _, _ = g16(parts)
            assert g16_kinds >> (kind - KIND_Q4_G16) & 1, f"no 16-wide kernel for kind {kind}"
            return out, kind

        self.keep: list[np.ndarray] = []  # every array a pointer in the structs points into
        self.layers = (DecodeLayer * nl)()
        num_blocks = -(-max_len // BLOCK_SIZE)
        kv_shape = (arch.num_kv_heads, num_blocks, BLOCK_SIZE, d)
        for i, spec in enumerate(self.layers):
            b = f"blk.{i}."
            arrays = {
                "input_norm": f32(b + "attn_norm.weight"),
                "post_norm": f32(b + "ffn_norm.weight"),
                "k_cache": np.zeros(kv_shape, np.float32),
                "v_cache": np.zeros(kv_shape, np.float32),
            }
            for field, (names, heads) in {
                "qkv": (
                    ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
                    (arch.num_heads, arch.num_kv_heads, 0),
                ),
                "o": (("attn_output.weight",), ()),
                "gate_up": (("ffn_gate.weight", "ffn_up.weight"), ()),
                "down": (("ffn_down.weight",), ()),
            }.items():
                arrays[field], kind = weight(*(b + n for n in names), heads=heads)
                setattr(spec, f"{field}_kind", kind)
            for field, array in arrays.items():
                setattr(spec, field, array.ctypes.data)
                self.keep.append(array)
        self.final_norm = f32("output_norm.weight")
        # The tied embedding: the LM head on its blocks, lookups from the same blocks.
        self.embed, self.embed_kind = weight("token_embd.weight")
        self.vocab = t["token_embd.weight"].shape[0]
        gguf.release_pages()  # (as the loader: the file's pages leave this process's RSS)
        self.spec = DecodeModel(
            hidden=h,
            heads=arch.num_heads,
            kv_heads=arch.num_kv_heads,
            head_dim=d,
            intermediate=arch.intermediate_size,
            num_layers=nl,
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            eps=arch.rms_norm_eps,
            scale=d**-0.5,
            final_norm=self.final_norm.ctypes.data,
            int8_activations=2,  # int8x2, the default --cpu-activation-dtype
            kv_type=0,  # float32: --kv-cache-dtype auto on a float32 model
            lora_slot=None,
            lora_wtype=0,
        )
        # RoPE tables (layers.RotaryEmbedding, neox): its formula in float32. Not its bits:
        # numpy's float32 pow differs from PyTorch's in 5 of the 32 inverse frequencies (an
        # ulp, 2.4e-4 at position 8191) and cos/sin in some entries (an ulp): a torch-free
        # runner needs one table function that both runners share.
        inv_freq = np.float32(1.0) / (
            np.float32(arch.rope_theta)
            ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))
        )
        freqs = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        self.cos, self.sin = np.cos(emb), np.sin(emb)
        self.table = np.arange(num_blocks, dtype=np.int64)  # one request: block i is block i
        self.hidden_out = np.empty((MAX_ROWS, h), np.float32)

    def embeddings(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty((len(ids), self.arch.hidden_size), np.float32)
        self.lib.gguf_dequantize_rows_f32(
            self.embed.ctypes.data, self.embed_kind, self.vocab, self.arch.hidden_size,
            ids.ctypes.data, len(ids), out.ctypes.data,
        )  # fmt: skip
        return out

    def step(self, ids: np.ndarray, start: int) -> np.ndarray:
        """Tokens `ids` at positions start.. (one request): their final-norm outputs."""
        m = len(ids)
        assert 0 < m <= MAX_ROWS
        emb = self.embeddings(ids)
        pos = np.arange(start, start + m, dtype=np.int64)
        cos, sin = np.ascontiguousarray(self.cos[pos]), np.ascontiguousarray(self.sin[pos])
        lens = (pos + 1).astype(np.int32)
        out = self.hidden_out[:m]
        self.lib.decode_layers_f32(
            ctypes.addressof(self.spec), ctypes.addressof(self.layers), emb.ctypes.data, m,
            cos.ctypes.data, sin.ctypes.data, pos.ctypes.data, self.table.ctypes.data, 0,
            lens.ctypes.data, int(lens[-1]), out.ctypes.data, self.num_threads,
        )  # fmt: skip
        return out

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        hidden = np.ascontiguousarray(hidden)
        m, k = hidden.shape
        out = np.empty((m, self.vocab), np.float32)
        self.lib.gguf_linear_i8x2(
            hidden.ctypes.data, k, m, k, self.embed.ctypes.data, self.embed_kind, self.vocab,
            out.ctypes.data, self.vocab, self.num_threads,
        )  # fmt: skip
        return out


def prototype(args: argparse.Namespace) -> dict[str, object]:
    from treadle.config import default_model_path  # torch-free

    threads = args.threads or len(os.sched_getaffinity(0))
    before = memory("at start (python, numpy, treadle.config)")
    isa = kernel_lib.select_isa()
    lib = load_kernels(isa)
    t0 = time.perf_counter()
    model = TorchlessModel(default_model_path(), lib, threads, len(PROMPT_IDS) + args.tokens)
    load_s = time.perf_counter() - t0
    weight_mib = (model.embed.nbytes + sum(a.nbytes for a in model.keep)) / 2**20
    print(f"loaded in {load_s:.2f} s on {isa}, {threads} threads; arrays {weight_mib:.1f} MiB")
    loaded = memory("after loading")
    ids = np.array(PROMPT_IDS, dtype=np.int64)
    t0 = time.perf_counter()
    for lo in range(0, len(ids), MAX_ROWS):
        hidden = model.step(ids[lo : lo + MAX_ROWS], lo)
    token = int(np.argmax(model.logits(hidden[-1:])[0]))
    prefill_s = time.perf_counter() - t0
    out = [token]
    t0 = time.perf_counter()
    for i in range(args.tokens - 1):
        hidden = model.step(np.array([token], dtype=np.int64), len(PROMPT_IDS) + i)
        token = int(np.argmax(model.logits(hidden)[0]))
        out.append(token)
    decode_s = time.perf_counter() - t0
    tok_s = (args.tokens - 1) / decode_s
    print(
        f"prefill {len(ids)} tokens {prefill_s * 1000:.0f} ms; decode {args.tokens - 1} steps "
        f"{decode_s:.2f} s = {tok_s:.1f} tok/s (single stream, {threads} threads)"
    )
    names = sorted(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))
    print(f"OS threads: {len(names)} ({', '.join(names)}); the kernels ran on {threads}")
    decoded = memory("after decoding")
    assert "torch" not in sys.modules, "the prototype imported torch"
    print("'torch' in sys.modules: False")
    return {
        "tokens": out,
        "isa": isa,
        "threads": threads,
        "tok_s": tok_s,
        "prefill_ms": prefill_s * 1000,
        "memory": {"start": before, "loaded": loaded, "decoded": decoded},
    }


def reference(tokens: int) -> None:
    """treadle itself (this process imports torch): the same prompt ids, greedy."""
    from treadle import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    print(f"REFERENCE_TIME {seconds:.2f} s for the prompt and {tokens} tokens", flush=True)
    print("REFERENCE_MEMORY " + json.dumps(memory("treadle offline (one process, torch)")))
    print("REFERENCE " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    print("TEXT " + json.dumps(out[0].outputs[0].text), flush=True)
    os._exit(0)  # (skip the engine's teardown: only the tokens matter here)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens to decode greedily")
    parser.add_argument("--threads", type=int, default=0, help="default: the CPUs we may use")
    parser.add_argument("--no-reference", action="store_true", help="skip treadle's run")
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.reference:
        reference(args.tokens)
    result = prototype(args)
    if not args.no_reference:
        env = dict(os.environ, TREADLE_ENABLE_MULTIPROCESSING="0")
        cmd = [sys.executable, __file__, "--reference", "--tokens", str(args.tokens)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("REFERENCE ")]
        if run.returncode != 0 or not lines:
            print(run.stderr[-3000:], file=sys.stderr)
            raise SystemExit("treadle's reference run failed")
        ref = json.loads(lines[-1].removeprefix("REFERENCE "))
        for ln in run.stdout.splitlines():
            if ln.startswith(("REFERENCE_TIME", "REFERENCE_MEMORY", "memory")):
                print("treadle: " + ln)
        ours = result["tokens"]
        assert isinstance(ours, list)
        diff = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        result["reference"] = ref
        result["first_difference"] = diff
        print(
            f"tokens: identical to treadle's ({len(ref)} of {len(ref)}, greedy)"
            if diff is None
            else f"tokens: first difference at output position {diff}: {ours[diff]} vs {ref[diff]}"
        )
    print("tokens " + json.dumps(result["tokens"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
