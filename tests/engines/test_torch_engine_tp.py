"""Tensor-parallel generation inside the engine: TP(2) over 2 gloo processes equals one device.

Each rank holds its Megatron shards (column slices of q/k/v/gate/up, row slices of o/down) and
decodes through each of the engine's structures: the plain step, fused q|k|v and gate|up weights
(concatenated from the local slices), and the compiled decode pieces with the all-reduces between
them (both layouts of ``FUSE_DECODE_EPILOGUES``; compiled with dynamo's "eager" backend on CPU).
Greedy and sampled tokens must equal the single-device engine's under the same generator: the
ranks of a TP group must draw the same noise, or their caches would hold different tokens.
CUDA graphs around the NCCL all-reduces are checked on GPUs by ``benchmarks/multi_gpu.py
--scenario tp`` (gloo collectives cannot be captured).
"""
import torch

from rlkit.engines import SamplingParams, TorchEngine
from rlkit.models import tiny
from rlkit.models.tokenizers import char_tokenizer
from rlkit.parallel.local import run_local

TEXTS = ["12+3=", "7", "abc def gh", "99", "a+b=c"]
VARIANTS = {  # name -> (engine options, FUSE_DECODE_EPILOGUES)
    "plain": (dict(fuse=False, compile_decode=False), True),
    "fused": (dict(fuse=True, compile_decode=False), True),
    "compiled": (dict(fuse=True, compile_decode=True), True),
    "compiled-halves": (dict(fuse=True, compile_decode=True), False),
}
TEMPERATURES = (0.0, 1.0)


def _setup():
    tok = char_tokenizer("0123456789+= abcdefghij")
    # initializer_range 0.2: peaked next-token distributions, so token equality can fail
    model = tiny(tok, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.2, tie_word_embeddings=False).eval()
    return model, [tok.encode(t) for t in TEXTS]


def _generate(engine, prompts, temperature):
    params = SamplingParams(n=2, max_new_tokens=9, temperature=temperature, ignore_stop=True)
    out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(7))
    return out.response_ids.clone(), out.logprobs.clone()


def _worker():
    import torch.distributed as dist

    from rlkit.engines import torch_engine as te
    from rlkit.parallel import init_distributed, shutdown
    from rlkit.parallel.reshard import shard_dim

    init_distributed("gloo")
    try:
        model, prompts = _setup()
        rank = dist.get_rank()
        shards = {}
        for name, p in model.named_parameters():
            dim = shard_dim(name, p.dim())
            shards[name] = p.detach() if dim is None else p.detach().chunk(2, dim)[rank].clone()
        te._COMPILED = tuple(torch.compile(fn, backend="eager", dynamic=False) for fn in te._DECODE_PIECES)
        results = {}
        for name, (options, epilogues) in VARIANTS.items():
            te.FUSE_DECODE_EPILOGUES = epilogues
            engine = TorchEngine(model.config, shards, tp_group=dist.group.WORLD, decode_attention="sdpa", **options)
            results[name] = {
                "outs": {t: _generate(engine, prompts, t) for t in TEMPERATURES},
                "fused": engine.fused, "compiled": engine._compiled is not None, "error": engine.compile_error,
                "heads": engine.num_heads, "q_rows": engine.weights["model.layers.0.self_attn.q_proj.weight"].shape[0],
            }
        return results
    finally:
        shutdown()


def test_tensor_parallel_engine_equals_one_device_in_every_decode_structure():
    results = run_local(_worker, 2, timeout=240)
    model, prompts = _setup()
    single = TorchEngine.from_model(model, fuse=False, compile_decode=False, decode_attention="sdpa")
    ref = {t: _generate(single, prompts, t) for t in TEMPERATURES}
    assert not torch.equal(ref[0.0][0], ref[1.0][0])  # sampling differs from greedy: both are tested
    for rank, result in enumerate(results):
        for name, (options, _) in VARIANTS.items():
            got = result[name]
            assert got["heads"] == 2 and got["q_rows"] * 2 == model.config.hidden_size, (rank, name)
            assert got["fused"] == options["fuse"] and got["compiled"] == options["compile_decode"], (rank, name)
            assert got["error"] is None, (rank, name, got["error"])
            for t in TEMPERATURES:
                ids, logprobs = got["outs"][t]
                assert torch.equal(ids, ref[t][0]), (rank, name, t)
                # the all-reduce adds the two halves' partial sums: float32 rounding only
                torch.testing.assert_close(logprobs, ref[t][1], rtol=0, atol=1e-5, msg=f"rank {rank} {name} T={t}")
