"""`--kv-cache-dtype float16|bfloat16|int8`: the KV write and the attention kernel at every ISA
level this CPU runs, against PyTorch and against float references.

Tolerances. The kernels read back exactly the values the cache stores (a 16-bit value widens
exactly; an int8 row is q * its float32 scale), so against attention computed in float32 over
those stored values they agree as the float32 kernels do (1e-5: summation order). Against the
unrounded K and V, each stored element is off by at most half a unit in its last place: 2^-11
|x| (float16), 2^-8 |x| (bfloat16), scale / 2 = max|row| / 254 (int8), which is asserted
first. To first order an output then moves by at most max|dV| (the probabilities sum to 1)
plus 2 max_t |ds_t| max|V|, with ds_t = scale |q|_1 max|dK_t| the score's error: that bound is
computed from the data of each case (x 1.1, + 1e-5 for the second order and the summation)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from treadle.model import cpu_kernels
from treadle.model.attention import (
    AttentionMetadata,
    CpuKernelAttention,
    PrefillChunk,
    TorchAttention,
    dequantize_int8,
    from_cache_rows,
    kv_row_shape,
    quantize_int8,
    to_cache_rows,
)

KV_DTYPES = ("float32", "float16", "bfloat16", "int8")
ISAS = cpu_kernels.available_isas()
needs_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason="no C compiler here (or TREADLE_CPU_KERNELS=0): the kernels cannot be built",
)


def empty_cache(kv: int, blocks: int, block_size: int, d: int, kv_dtype: str) -> torch.Tensor:
    dtype, width = kv_row_shape(kv_dtype, d)
    return torch.zeros(kv, blocks, block_size, width, dtype=dtype)


def rounding_bound(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Half a unit in the last place of each element of x as the cache stores it."""
    if kv_dtype == "float32":
        return torch.zeros_like(x)
    if kv_dtype == "int8":
        return x.abs().amax(-1, keepdim=True).expand_as(x) / 254 * (1 + 1e-6)
    # |x| 2^-p, and the float16 subnormals' fixed step 2^-25 below 2^-14
    u = 2.0**-11 if kv_dtype == "float16" else 2.0**-8
    floor = 2.0**-25 if kv_dtype == "float16" else 0.0
    return torch.maximum(x.abs() * u, torch.full_like(x, floor))


def test_int8_round_trip() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, quants 0
    packed = quantize_int8(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 3, 68)
    back = dequantize_int8(packed, torch.float32)
    assert torch.equal(back[0, 0], torch.zeros(64))
    assert ((back - x).abs() <= rounding_bound(x, "int8")).all()
    q = packed[..., :64].to(torch.int32)
    assert q.abs().max() == 127 and (q.abs().amax(-1) == 127).sum() == 50 * 3 - 1
    assert torch.equal(quantize_int8(back), packed)  # dequantized values quantize to the same


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_kernel_write_makes_the_same_bits_as_pytorch(isa: str, kv_dtype: str) -> None:
    """Round to nearest even (float16, bfloat16) and rint(x * 127 / max|x|) (int8), on values
    that test the edges: ties, float16 overflow (65520 -> inf, 65504 kept) and subnormals."""
    kernels = cpu_kernels.kernels_for(isa)
    torch.manual_seed(1)
    kv, d, bs, nb = 2, 40, 16, 8  # 40: vector loops and a scalar tail at every level
    k = torch.randn(70, kv, d) * 3
    v = torch.randn(70, kv, d)
    if kv_dtype != "int8":
        edges = [65504.0, 65519.0, 65520.0, -7e4, 1e-6, 3e-8, 2.0**-25, 1.0 + 2.0**-11]
        edges += [1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, float("inf")]
        k[0, 0, : len(edges)] = torch.tensor(edges)
    slots = torch.randperm(nb * bs)[:70]
    ours_k, ours_v = empty_cache(kv, nb, bs, d, kv_dtype), empty_cache(kv, nb, bs, d, kv_dtype)
    kernels.write_kv(k, v, slots, ours_k, ours_v)
    for cache, x in ((ours_k, k), (ours_v, v)):
        width = cache.shape[3]
        expected = torch.zeros_like(cache)
        expected.view(kv, -1, width)[:, slots] = to_cache_rows(x, expected).transpose(0, 1)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
        stored = from_cache_rows(cache.view(kv, -1, width)[:, slots], torch.float32)
        exact = x.transpose(0, 1)
        finite = exact.abs() <= 65504 if kv_dtype == "float16" else exact.isfinite()
        err = (stored - exact).abs()
        assert (err[finite] <= rounding_bound(exact, kv_dtype)[finite]).all()


def attention_case(
    kv_dtype: str, heads: int, kv: int, d: int, lengths: list[int]
) -> dict[str, Any]:
    """Random K/V written through the cache's rounding, a decode per request of `lengths`."""
    torch.manual_seed(2)
    bs, nb = 16, 200
    k_exact = torch.randn(kv, nb, bs, d)
    v_exact = torch.randn(kv, nb, bs, d)
    k_cache = empty_cache(kv, nb, bs, d, kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache.copy_(to_cache_rows(k_exact, k_cache))
    v_cache.copy_(to_cache_rows(v_exact, v_cache))
    max_blocks = -(-max(lengths) // bs)
    table = torch.randperm(nb)[: len(lengths) * max_blocks].view(len(lengths), max_blocks)
    return dict(k_exact=k_exact, v_exact=v_exact, k_cache=k_cache, v_cache=v_cache,
                table=table, q=torch.randn(len(lengths), heads, d), lengths=lengths)  # fmt: skip


def reference(case: dict[str, Any], k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64 over caches k, v [kv, nb, bs, d] (float)."""
    q, table, lengths = case["q"].double(), case["table"], case["lengths"]
    kv, d = k.shape[0], k.shape[3]
    group = q.shape[1] // kv
    out = []
    for r, n in enumerate(lengths):
        kr = k[:, table[r]].reshape(kv, -1, d)[:, :n].double()
        vr = v[:, table[r]].reshape(kv, -1, d)[:, :n].double()
        qr = q[r].view(kv, group, d)
        p = torch.softmax(qr @ kr.transpose(-1, -2) * d**-0.5, dim=-1)
        out.append((p @ vr).reshape(-1))
    return torch.stack(out)


def first_order_bound(case: dict[str, Any], k: torch.Tensor, v: torch.Tensor) -> float:
    """max|dV| + 2 max|ds| max|V| over the contexts (see the module's docstring)."""
    dk = (k - case["k_exact"]).abs().amax(-1)  # [kv, nb, bs]: max|dK_t| per row
    dv = (v - case["v_exact"]).abs().max().item()
    d = k.shape[3]
    ds = d**-0.5 * case["q"].abs().sum(-1).max().item() * dk.max().item()
    return 1.1 * (dv + 2 * ds * case["v_exact"].abs().max().item()) + 1e-5


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv", "d"), [(9, 3, 64), (8, 2, 32)])
def test_decode_attention_reads_the_cache_type(
    isa: str, kv_dtype: str, heads: int, kv: int, d: int
) -> None:
    """Head size 64 takes the hand-tiled path at avx2/avx512 (group 3), 32 the generic loop."""
    lengths = [1, 7, 8, 9, 16, 17, 100, 333, 40]
    case = attention_case(kv_dtype, heads, kv, d, lengths)
    out = torch.empty(len(lengths), heads * d)
    cpu_kernels.kernels_for(isa).paged_decode_attention(
        case["q"], case["k_cache"], case["v_cache"], case["table"],
        torch.tensor(lengths, dtype=torch.int32), max(lengths), out, d**-0.5,
    )  # fmt: skip
    k = from_cache_rows(case["k_cache"], torch.float32)
    v = from_cache_rows(case["v_cache"], torch.float32)
    torch.testing.assert_close(out.double(), reference(case, k, v), rtol=1e-5, atol=1e-5)
    err = (out.double() - reference(case, case["k_exact"], case["v_exact"])).abs().max().item()
    bound = first_order_bound(case, k, v)
    assert err <= bound, (err, bound)
    if kv_dtype != "float32":
        assert err > 1e-7  # the cache really was rounded


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:])
def test_kernel_and_pytorch_backends_agree_on_a_rounded_cache(isa: str, kv_dtype: str) -> None:
    """A decode batch and two prefill chunks (one after 40 cached tokens) through both
    backends' write and read: the same stored bits, outputs within float32 summation."""
    torch.manual_seed(3)
    heads, kv, d, bs, nb = 9, 3, 64, 16, 64
    caches = (empty_cache(kv, nb, bs, d, kv_dtype), empty_cache(kv, nb, bs, d, kv_dtype))
    for c in caches:
        c.copy_(to_cache_rows(torch.randn(kv, nb, bs, d), c))
    chunks, slots, start = [], [], 0
    for cached, n in [(40, 37), (0, 21)]:
        total = cached + n
        blocks = torch.randperm(nb)[: -(-total // bs)]
        pos = torch.arange(cached, total)
        ctx = torch.arange(len(blocks) * bs)
        bias = torch.zeros(n, len(ctx)).masked_fill_(ctx[None, :] > pos[:, None], float("-inf"))
        chunks.append(PrefillChunk(start, start + n, blocks, (pos + 1).to(torch.int32), bias))
        slots += [int(blocks[p // bs]) * bs + p % bs for p in pos]
        start += n
    q = torch.randn(start, heads, d)
    k, v = torch.randn(start, kv, d), torch.randn(start, kv, d)
    results = []
    for backend in (CpuKernelAttention(cpu_kernels.kernels_for(isa)), TorchAttention()):
        kc, vc = caches[0].clone(), caches[1].clone()
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), prefills=chunks)
        results.append((backend.forward(q, k, v, kc, vc, meta, d**-0.5), kc, vc))
    (ours, kc, vc), (theirs, kt, vt) = results
    assert torch.equal(kc.view(torch.uint8), kt.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vt.view(torch.uint8))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


# -- end to end ---------------------------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_ENABLE_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def tiny_d64(tiny_model_builder: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head size 64 and 2 query heads per KV head (the hand-tiled path)."""
    return tiny_model_builder(  # type: ignore[no-any-return]
        tmp_path_factory.mktemp("tiny-d64"), "llama", hidden_size=256, num_attention_heads=4
    )


PROMPTS = [list(range(100, 140)), [504, 3575, 282, 4649, 314], [42] * 20]


@needs_kernels
@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("family", ["llama", "d64"])
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "int8"])
def test_greedy_output_on_the_kernels_is_the_pytorch_paths(
    family: str, kv_dtype: str, tiny_model_factory: Any, tiny_d64: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """End to end (prefill chunks, prefix-cache hits and decode steps) with each cache type:
    the C kernels and the PyTorch path store the same bits and read them back alike, so the
    greedy tokens are the same; the cache really is of that type. (Against the float32 cache
    these random models' logits are too close for greedy tokens to agree throughout: that is
    measured on the default model by benchmarks/quality.py.) Head size 16: the generic
    loop; 64: the tiled path."""
    from treadle import LLM, SamplingParams

    model = str(tiny_d64 if family == "d64" else tiny_model_factory("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # the second prompt repeats the first's first 32 tokens: a prefix-cache hit
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[0][:32] + [7, 8, 9]]]
    outputs = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(cpu_kernels, "_selected", [None])  # the PyTorch paths
        llm = LLM(model, kv_cache_dtype=kv_dtype, max_model_len=256, kv_cache_memory="8MiB",
                  max_num_batched_tokens=24)  # fmt: skip
        try:
            runner = llm.engine_core.executor.worker.runner  # type: ignore[union-attr]
            assert runner.kv_caches[0][0].dtype == getattr(torch, kv_dtype)
            assert runner.model.kernels is (cpu_kernels.load() if kernels else None)
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs.append([list(o.outputs[0].token_ids) for o in outs])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


def test_the_same_memory_holds_more_tokens(default_model_path: str) -> None:
    from treadle.config import resolve_model
    from treadle.worker.start_checks import kv_bytes_per_block, model_arch

    arch = model_arch(resolve_model(default_model_path))
    per = {name: kv_bytes_per_block(arch, name, 16) for name in KV_DTYPES}
    assert per["float32"] == 2 * per["float16"] == 2 * per["bfloat16"]
    assert per["float32"] / per["int8"] == 4 * arch.head_dim / (arch.head_dim + 4)


def test_the_start_up_check_sizes_the_cache_by_its_dtype(tiny_model_factory: Any) -> None:
    """64 KiB hold 128 tokens of the tiny model in float32 (8 blocks); 256 tokens need a
    16-bit cache, 400 an int8 one (head size 16: 20 bytes a row against 64, 3.2x)."""
    from treadle.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from treadle.worker.start_checks import check_config

    tiny = str(tiny_model_factory("llama"))

    def check(max_model_len: int, kv_dtype: str) -> None:
        cache = CacheConfig(kv_cache_memory=64 << 10, kv_cache_dtype=kv_dtype)
        check_config(EngineConfig(ModelConfig(tiny, max_model_len=max_model_len), cache,
                                  SchedulerConfig()))  # fmt: skip

    check(128, "auto")
    with pytest.raises(ValueError, match="holds only 128 tokens"):
        check(256, "auto")
    check(256, "bfloat16")
    with pytest.raises(ValueError, match="holds only 256 tokens"):
        check(400, "float16")
    check(400, "int8")


def test_fp8_and_unknown_types_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from treadle.cli.main import main
    from treadle.engine_args import EngineArgs

    for bad in ("fp8", "fp8_e4m3", "fp8_e5m2", "float32x"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--kv-cache-dtype", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"--kv-cache-dtype: invalid choice: '{bad}'" in err
        assert "'auto', 'float16', 'bfloat16', 'int8'" in err
        args, _ = EngineArgs.from_kwargs(kv_cache_dtype=bad)
        with pytest.raises(ValueError, match=f"--kv-cache-dtype '{bad}': choose one of auto, "):
            args.create_engine_config()
    good, _ = EngineArgs.from_kwargs(kv_cache_dtype="int8")
    assert good.create_engine_config().cache.kv_cache_dtype == "int8"


@pytest.mark.usefixtures("in_process")
def test_a_prompt_cache_file_of_another_dtype_is_refused(
    tiny_model_factory: Any, tmp_path: Path
) -> None:
    """An int8 file restores into an int8 cache (a prefix hit, the same greedy output); a
    float16 or float32 cache refuses it, naming both dtypes and the flag."""
    from treadle import LLM, SamplingParams

    model = str(tiny_model_factory("llama"))
    prompt = " ".join(f"word{i}" for i in range(60))
    greedy = SamplingParams(temperature=0, max_tokens=8)

    def engine(kv_dtype: str) -> LLM:
        return LLM(model, kv_cache_save_path=str(tmp_path), max_model_len=256,
                   kv_cache_memory="8MiB", kv_cache_dtype=kv_dtype)  # fmt: skip

    llm = engine("int8")
    try:
        first = llm.generate([prompt], greedy, use_tqdm=False)[0]
        saved = llm.save_prompt_cache(prompt, "p.bin")
        assert saved["n_saved"] > 0
        llm.engine_core.reset_prefix_cache()
        assert llm.restore_prompt_cache("p.bin")["n_restored"] == saved["n_saved"]
        again = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.shutdown()
    for other in ("float16", "auto"):
        llm = engine(other)
        try:
            shown = "float32" if other == "auto" else other
            # the engine core checks the header (core/prompt_cache.py) before any worker reads
            with pytest.raises(ValueError, match=f"saved with dtype 'int8' .*has '{shown}'"):
                llm.restore_prompt_cache("p.bin")
            assert llm.get_stats().kv_cache_usage == 0.0
        finally:
            llm.shutdown()
    assert os.path.exists(tmp_path / "p.bin")


def test_the_file_format_keeps_int8_rows_and_names_the_dtype(tmp_path: Path) -> None:
    """A worker's file (`kv_file.py`): int8 rows with their scales round trip, the header says
    head_dim (not the row's bytes) and int8; another dtype's cache refuses it, naming the flag."""
    from treadle.worker import kv_file

    torch.manual_seed(4)
    caches = [(empty_cache(2, 6, 16, 32, "int8"), empty_cache(2, 6, 16, 32, "int8"))]
    for c in caches[0]:
        c.copy_(to_cache_rows(torch.randn(2, 6, 16, 32), c))
    path = str(tmp_path / "f.bin")
    kv_file.save_blocks(path, caches, [4, 1], {"token_ids": list(range(32))})
    header = kv_file.read_header(path)
    assert header["dtype"] == "int8" and header["head_dim"] == 32
    back = [(torch.zeros_like(caches[0][0]), torch.zeros_like(caches[0][1]))]
    kv_file.load_blocks(path, back, {0: 2, 1: 3}, {})
    assert torch.equal(back[0][0][:, 2:4], caches[0][0][:, [4, 1]])
    assert torch.equal(back[0][1][:, 2:4], caches[0][1][:, [4, 1]])
    other = [(empty_cache(2, 6, 16, 32, "float16"), empty_cache(2, 6, 16, 32, "float16"))]
    with pytest.raises(kv_file.KVFileError, match="int8 KV cache .*is float16 .*-dtype int8"):
        kv_file.load_blocks(path, other, {0: 0}, {})


@needs_kernels
def test_the_fused_decode_reads_and_writes_each_cache_type(default_model_path: str) -> None:
    """The one-call decode (`fused_decode.py`) against the modules, on the default model at
    this CPU's best level: the same hidden states and cache bytes, to the bit, per type."""
    from treadle.config import resolve_model
    from treadle.model.loader import load_model, read_arch

    source = resolve_model(default_model_path)
    model = load_model(source, read_arch(source), torch.float32, torch.device("cpu"), 512)
    fused = model.fused
    if fused is None:
        pytest.skip("no fused decode at this level (its linear layers are not on the blocks)")
    lengths = [5, 37, 300][: fused.max_rows]
    bs, nb = 16, 64
    table = (torch.arange(len(lengths) * 19).view(len(lengths), 19) * 7) % nb
    slots = [int(table[r, (n - 1) // bs]) * bs + (n - 1) % bs for r, n in enumerate(lengths)]
    ids = torch.tensor([1000 + 7 * n for n in lengths])
    positions = torch.tensor([n - 1 for n in lengths])
    for kv_dtype in ("float16", "bfloat16", "int8"):
        torch.manual_seed(5)
        caches = []
        for _ in range(model.num_layers):
            pair = (empty_cache(model.num_kv_heads, nb, bs, model.head_dim, kv_dtype),
                    empty_cache(model.num_kv_heads, nb, bs, model.head_dim, kv_dtype))  # fmt: skip
            for c in pair:
                c.copy_(to_cache_rows(torch.randn(c.shape[:3] + (model.head_dim,)), c))
            caches.append(pair)
        results = []
        for use_fused in (True, False):
            model.fused = fused if use_fused else None
            ours = [(k.clone(), v.clone()) for k, v in caches]
            meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots), num_decodes=len(lengths),
                decode_block_table=table, decode_lens=torch.tensor(lengths, dtype=torch.int32),
                decode_max_len=max(lengths),
            )  # fmt: skip
            with torch.inference_mode():
                results.append((model(ids, positions, ours, meta), ours))
        model.fused = fused
        (got, got_caches), (expected, expected_caches) = results
        assert fused._spec.kv_type == cpu_kernels.KV_TYPES[getattr(torch, kv_dtype)]
        assert torch.equal(got, expected), kv_dtype
        for pair, other in zip(got_caches, expected_caches, strict=True):
            for a, b in zip(pair, other, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), kv_dtype
