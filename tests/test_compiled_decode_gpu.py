"""transformers' own compiled decode of a bitsandbytes 4-bit model, with
``patch_bitsandbytes(compiled_decode=True)``: ``generate(cache_implementation="static")`` compiles
the decode step (torch.compile, "reduce-overhead": CUDA graphs) and gives the tokens of the same
mode's eager decode; in matmul mode its logits stay as close to an fp64 copy of the model as
bitsandbytes' own; models it is not proven on decode eager, with a warning. A small Llama built
from a config (2 layers, hidden 2048, random weights, nf4 nested, bf16). GPU only."""

from __future__ import annotations

import pytest
import torch

import harness
from harness.correctness import cases, qlora
from harness.correctness import matmul_reference as mr
from harness.correctness import model_reference as dr
from harness.runtime import patch

pytestmark = pytest.mark.gpu

NEW_TOKENS = 12
GREEDY = {"do_sample": False, "pad_token_id": 0, "min_new_tokens": NEW_TOKENS, "max_new_tokens": NEW_TOKENS}
ERROR_SLACK = 1.10  # as tests/test_e2e_matmul_gpu.py: at most this times bitsandbytes' own error


@pytest.fixture(scope="module")
def small_model(small_checkpoint):
    model = qlora.load_quantized(small_checkpoint).eval()
    yield model
    del model
    torch.cuda.empty_cache()


def _compiled_generate(model, ids, **kwargs):
    """transformers' generate with a static cache, and whether it compiled the decode step (it keeps
    the compiled call on the model once it made one)."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch._dynamo.reset()
    out = model.generate(ids, cache_implementation="static", **GREEDY, **kwargs)
    return out, hasattr(model, "_compiled_call")


@pytest.mark.parametrize("matmul", [False, True], ids=["default", "matmul"])
@pytest.mark.parametrize("batch", [1, 8])
def test_compiled_greedy_decode_picks_the_eager_decodes_tokens_of_its_mode(bnb, cuda, small_model, matmul, batch):
    """Each compiled step's logits beside the same mode's eager decode fed the same tokens: the
    compiled decode picks the eager decode's token wherever the two computations' difference could
    not flip it (inductor fuses the norms, activations and attention with other roundings than
    eager PyTorch, so on a random-weight model's near-ties either token may come; seen on an H100:
    the default mode's greedy tokens at batch 8 left the eager ones after a few steps)."""
    prompt = 8
    ids = qlora.random_tokens(small_model.config.vocab_size, batch, prompt, seed=30 + batch)
    with harness.bitsandbytes_patched(matmul=matmul, compiled_decode=True):
        before = patch.routed_calls().get("gemm_4bit fused: ours", 0)
        out, did_compile = _compiled_generate(small_model, ids, output_logits=True, return_dict_in_generate=True)
        fused = patch.routed_calls().get("gemm_4bit fused: ours", 0) - before
        eager = dr.decode_logits(small_model, out.sequences, prompt)  # a dynamic cache: eager
    assert not hasattr(small_model, "_compiled_call"), "the step compiled under the patch went with it"
    assert did_compile, "transformers did not compile the decode step"
    assert fused > 0 if matmul else fused == 0
    compiled = torch.stack(out.logits, dim=1).double()
    assert torch.equal(compiled.argmax(-1), out.sequences[:, prompt:]), "greedy: each token is its step's top-1"
    agreement = dr.distance(compiled, eager, dr.tie_margin(compiled, eager))
    print(f"\ncompiled against eager decode, batch {batch}: {agreement}")
    assert agreement.decided > 0 and agreement.decided_misses == 0, agreement
    _, did_compile = _compiled_generate(small_model, ids)  # unpatched: transformers' own refusal again
    assert not did_compile


def test_compiled_decode_in_matmul_mode_is_as_close_to_fp64_as_bitsandbytes(bnb, cuda, small_model):
    """The logits of each compiled decode step against an fp64 copy of the model fed the same
    tokens, beside bitsandbytes' own (eager, unpatched) on the same tokens."""
    batch, prompt = 8, 8
    ids = qlora.random_tokens(small_model.config.vocab_size, batch, prompt, seed=41)
    with harness.bitsandbytes_patched(matmul=True, compiled_decode=True):
        out, did_compile = _compiled_generate(small_model, ids, output_logits=True, return_dict_in_generate=True)
    assert did_compile
    tokens, logits = out.sequences, torch.stack(out.logits, dim=1).double()
    reference = dr.fp64_reference(small_model)
    try:
        expected = dr.decode_logits(small_model, tokens, prompt)
        exact = dr.decode_logits(reference, tokens, prompt)
    finally:
        del reference
        torch.cuda.empty_cache()
    theirs, ours = dr.relative_error(expected, exact), dr.relative_error(logits, exact)
    print(f"\ncompiled decode, matmul mode: {ours:.3e} against fp64; bitsandbytes eager {theirs:.3e}")
    assert ours <= ERROR_SLACK * theirs, (ours, theirs)


def test_a_model_with_peft_adapters_decodes_eager_with_a_warning(bnb, cuda, small_model):
    peft = pytest.importorskip("peft", reason="the adapter case needs peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(small_model, lora)
    try:
        ids = qlora.random_tokens(small_model.config.vocab_size, 1, 8, seed=50)
        with harness.bitsandbytes_patched(compiled_decode=True):
            with pytest.warns(RuntimeWarning, match="compiled decode refused .*peft adapters"):
                _, did_compile = _compiled_generate(model.base_model.model, ids)
        assert not did_compile
    finally:
        model.unload()


def test_matmul_mode_computes_the_call_bitsandbytes_own_kernel_faults_on(bnb, cuda):
    """bitsandbytes 0.50.2's own 4-bit matmul raises "misaligned address" (a sticky error that
    loses the CUDA context) on activations [12, 64] with a weight quantized from [2911, 64] (nf4,
    blocks of 64, nested). Matmul mode takes that call: inside the fp64 bound. (bitsandbytes' own
    call is not made here: it would take the process' CUDA context with it.)"""
    import bitsandbytes

    w = torch.randn(2911, 64, generator=cases.seeded_generator(7, cuda), device=cuda).to(torch.bfloat16)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    A = torch.randn(12, 64, device=cuda).to(torch.bfloat16)
    before = patch.routed_calls().get("gemm_4bit fused: ours", 0)
    with harness.bitsandbytes_patched(matmul=True):
        got = bitsandbytes.matmul_4bit(A, packed.t(), state)
    assert patch.routed_calls().get("gemm_4bit fused: ours", 0) - before == 1, "matmul mode took the call"
    judged = mr.judge(
        got, mr.fused_reference(A, packed, state, harness.dequantize_4bit(packed, state), None, torch.bfloat16)
    )
    assert judged.ok, judged


@pytest.mark.multigpu
def test_a_model_split_over_two_gpus_decodes_eager_with_a_warning(bnb, cuda, small_checkpoint):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    try:
        split = qlora.load_quantized(small_checkpoint, qlora.split_over_two_gpus(2)).eval()
        ids = qlora.random_tokens(split.config.vocab_size, 2, 8, seed=60)
        eager = split.generate(ids, **GREEDY)
        with harness.bitsandbytes_patched(matmul=True, compiled_decode=True):
            with pytest.warns(RuntimeWarning, match="compiled decode refused .*split over"):
                out, did_compile = _compiled_generate(split, ids)
        assert not did_compile and out.shape == eager.shape
    finally:
        torch.cuda.empty_cache()
