"""End to end in matmul mode (``patch_bitsandbytes(matmul=True)``): a small Llama built from a
config (2 layers, hidden 2048, random weights, nf4 nested, bf16), its prefill and its greedy
decode (one token per step through the KV cache, as ``generate`` runs it), each measured against
an fp64 copy of the model with the exactly dequantized weights
(``harness.correctness.model_reference``), and a QLoRA step judged the same way.

A fused matmul is not bit-identical to cuBLAS, so the claim is relative and stated in the
README: matmul mode's logits are no farther from the fp64 logits than bitsandbytes' own (within
10%), and pick the fp64 model's top-1 token wherever bitsandbytes' own rounding could not flip
it: where the fp64 top-1 leads its runner-up by more than twice bitsandbytes' largest logit
error (a random-weight model has many near-ties, where any rounding may pick either). The fused
kernel must really have run: the routed-call counts say so.
"""

from __future__ import annotations

import pytest
import torch

import harness
from harness.correctness import model_reference as dr
from harness.correctness import qlora
from harness.runtime import patch
from harness.runtime.matmul import crossover_m

pytestmark = pytest.mark.gpu

ERROR_SLACK = 1.10  # matmul mode's relative error at most this times bitsandbytes'


@pytest.fixture(scope="module")
def small_model(small_checkpoint):
    model = qlora.load_quantized(small_checkpoint).eval()
    reference = dr.fp64_reference(model)
    yield model, reference
    del model, reference
    torch.cuda.empty_cache()


def _fused_calls() -> int:
    return patch.routed_calls().get("gemm_4bit fused: ours", 0)


def _judge(name: str, bnb_logits, fused_logits, ref_logits) -> None:
    margin = dr.tie_margin(bnb_logits, ref_logits)
    theirs, ours = dr.distance(bnb_logits, ref_logits, margin), dr.distance(fused_logits, ref_logits, margin)
    print(f"\n{name}: bitsandbytes {theirs}; matmul mode {ours}")
    assert ours.relative_error <= ERROR_SLACK * theirs.relative_error, (name, ours, theirs)
    assert ours.decided > 0 and ours.decided_misses == 0, (name, ours, theirs)


def _crossover(cuda, model) -> int:
    """The crossover of the model's 4-bit projections (by weight size): the fused-call counts
    below take one for all of them."""
    import bitsandbytes

    sizes = {m.weight.quant_state.shape.numel() for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)}
    rows = {crossover_m(cuda.index, size) for size in sizes}
    assert sizes and len(rows) == 1, f"the projections have different crossovers: {rows}"
    return rows.pop()


# Prefill shapes as shares of the GPU's crossover, so that the fused kernel takes them on every GPU:
# all of its rows in two sequences, and three quarters of them in one (96 and 128 rows on an H100 or H200).
@pytest.mark.parametrize(("batch", "share"), [(1, 0.75), (2, 1.0)], ids=["1xthree-quarters", "2xall"])
def test_prefill_in_matmul_mode_is_as_close_to_fp64_as_bitsandbytes(bnb, cuda, small_model, batch, share):
    model, reference = small_model
    seq = int(_crossover(cuda, model) * share) // batch
    ids = qlora.random_tokens(model.config.vocab_size, batch, seq, seed=batch)
    expected = dr.prefill_logits(model, ids)
    with harness.bitsandbytes_patched():  # the default mode changes no bit
        assert torch.equal(dr.prefill_logits(model, ids), expected), "default mode must stay bit-identical"
    before = _fused_calls()
    with harness.bitsandbytes_patched(matmul=True):
        got = dr.prefill_logits(model, ids)
    assert _fused_calls() - before == 2 * 7, "every projection of the prefill ran the fused kernel"
    _judge(f"prefill {batch}x{seq}", expected, got, dr.prefill_logits(reference, ids))


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_in_matmul_mode_is_as_close_to_fp64_as_bitsandbytes(bnb, cuda, small_model, batch):
    model, reference = small_model
    prompt, total = 8, 40
    ids = qlora.random_tokens(model.config.vocab_size, batch, total, seed=10 + batch)
    expected = dr.decode_logits(model, ids, prompt)
    before = _fused_calls()
    with harness.bitsandbytes_patched(matmul=True):
        got = dr.decode_logits(model, ids, prompt)
    # Every decode step (batch rows each), and the prefill where its rows are within the crossover.
    fused_steps = total - prompt - 1 + (batch * prompt <= _crossover(cuda, model))
    assert _fused_calls() - before == 2 * 7 * fused_steps, "every projection of every step ran the fused kernel"
    _judge(f"decode batch {batch}", expected, got, dr.decode_logits(reference, ids, prompt))


def test_greedy_generate_runs_in_matmul_mode(bnb, cuda, small_model):
    """transformers' own generate loop, greedy: it runs through the fused kernel and returns as
    many tokens; which tokens may differ where two logits are closer than the rounding."""
    model, _ = small_model
    ids = qlora.random_tokens(model.config.vocab_size, 4, 8, seed=3)
    kwargs = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(ids, **kwargs)
    before = _fused_calls()
    with harness.bitsandbytes_patched(matmul=True):
        got = model.generate(ids, **kwargs)
    # 15 decode steps of 4 rows each, and the 32-row prefill where it is within the crossover.
    assert _fused_calls() - before == 2 * 7 * (15 + (4 * 8 <= _crossover(cuda, model)))
    assert got.shape == expected.shape and torch.equal(got[:, :8], ids)
    agreement = (got[:, 8:] == expected[:, 8:]).double().mean().item()
    print(f"\ngreedy generate, batch 4, 16 new tokens: {agreement:.3f} of the tokens equal to bitsandbytes'")


@pytest.mark.parametrize("matmul", [False, True], ids=["default", "matmul"])
def test_a_decode_step_captured_as_a_cuda_graph_replays_its_eager_tokens(bnb, cuda, small_model, matmul):
    """Greedy decode over a static cache, one step captured as a CUDA graph (what the graphed
    decode table times): replaying it gives the tokens its eager steps give, bit for bit, with
    the fused kernel inside the graph in matmul mode."""
    from harness.perf.graphed_decode import GraphedDecode

    model, _ = small_model
    ids = qlora.random_tokens(model.config.vocab_size, 3, 8, seed=5)
    with harness.bitsandbytes_patched(matmul=matmul):
        before = _fused_calls()
        decode = GraphedDecode(model, ids, 12)
        fused = _fused_calls() - before  # the prefill (within the crossover), warm-up steps and capture
        eager = decode.run(graphed=False)
    replayed = decode.run()
    prefill = ids.numel() <= _crossover(cuda, model)
    assert fused == (2 * 7 * (prefill + decode.WARMUP_STEPS + 1) if matmul else 0)
    assert torch.equal(replayed, eager), (replayed, eager)
    assert torch.equal(decode.run(5), eager[:, :5])


def test_a_qlora_step_in_matmul_mode_is_as_close_to_fp64_as_bitsandbytes(bnb, cuda):
    """bitsandbytes' training forward runs gemm_4bit with autograd off, so matmul mode fuses it
    (16 tokens: within every GPU's crossover); the backward dequantizes as before. Every LoRA
    gradient together (one error over all their elements: a single tensor's or the scalar loss's
    error ratio is at the mercy of chance), against the same step in fp64."""
    pytest.importorskip("peft", reason="the QLoRA step needs peft")
    tmp = qlora.temporary_checkpoint(dims=qlora.SMALL_LLAMA, layers=2)
    try:
        m = qlora.load_qlora(tmp.name, seq=16)
        _loss, grads = qlora.train_step(m)
        before = _fused_calls()
        with harness.bitsandbytes_patched(matmul=True):
            _p_loss, p_grads = qlora.train_step(m)
        assert _fused_calls() - before == 2 * 7, "every projection's forward ran the fused kernel"
        _ref_loss, ref_grads = qlora.train_step(dr.fp64_qlora(m))
        assert set(grads) == set(p_grads) == set(ref_grads) and grads

        def flat(g: dict) -> torch.Tensor:
            return torch.cat([g[n].double().flatten() for n in sorted(grads)])

        reference = flat(ref_grads)
        theirs, ours = dr.relative_error(flat(grads), reference), dr.relative_error(flat(p_grads), reference)
        print(f"\nQLoRA step, LoRA gradients against fp64: bitsandbytes {theirs:.3e}, matmul mode {ours:.3e}")
        assert ours <= ERROR_SLACK * theirs, (ours, theirs)
    finally:
        torch.cuda.empty_cache()
        tmp.cleanup()


def _routed(seam: str) -> int:
    return patch.routed_calls().get(f"{seam}: ours", 0)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int64), b.cpu().view(torch.int64))


@pytest.mark.multigpu
def test_a_model_split_over_two_gpus_gives_its_one_gpu_results_in_each_mode(bnb, cuda, small_checkpoint, small_model):
    """The same checkpoint loaded with one layer on each GPU (``device_map``): in the default mode
    its prefill and decode logits are the one-GPU model's bits, and the patch routes both GPUs'
    dequantizations; in matmul mode every projection of both layers runs the fused kernel, the
    decode logits are as close to fp64 as bitsandbytes' own, and, on two GPUs of one model, the
    one-GPU matmul mode's bits and greedy tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model, reference = small_model
    split = qlora.load_quantized(small_checkpoint, qlora.split_over_two_gpus(2)).eval()
    try:
        layers = split.model.layers
        assert [layers[i].mlp.down_proj.weight.device.index for i in (0, 1)] == [0, 1]
        vocab = model.config.vocab_size
        # Default mode: 2048 prefill rows are over bitsandbytes' 1536, so every projection
        # dequantizes through gemm_4bit's fallback seam, on the GPU that holds its layer.
        ids = qlora.random_tokens(vocab, 2, 1024, seed=20)
        expected = dr.prefill_logits(model, ids)
        before = _routed("gemm_4bit fallback")
        with harness.bitsandbytes_patched():
            got = dr.prefill_logits(split, ids)
        assert _routed("gemm_4bit fallback") - before == 2 * 7, "both GPUs' projections went through the patch"
        assert _same_bits(got, expected), "default mode, split prefill"
        batch, prompt, total = 8, 8, 24
        ids = qlora.random_tokens(vocab, batch, total, seed=21)
        one_gpu = dr.decode_logits(model, ids, prompt)
        with harness.bitsandbytes_patched():
            assert _same_bits(dr.decode_logits(split, ids, prompt), one_gpu), "default mode, split decode"
        # Matmul mode.
        before = _fused_calls()
        with harness.bitsandbytes_patched(matmul=True):
            fused = dr.decode_logits(split, ids, prompt)
            fused_one_gpu = dr.decode_logits(model, ids, prompt)
        steps = total - prompt - 1 + (batch * prompt <= _crossover(cuda, model))
        assert _fused_calls() - before == 2 * (2 * 7 * steps), "every projection on both GPUs ran the fused kernel"
        _judge("split decode batch 8", one_gpu, fused.to(one_gpu.device), dr.decode_logits(reference, ids, prompt))
        if torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1):
            assert _same_bits(fused, fused_one_gpu), "matmul mode, split decode"
            kwargs = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
            prompt_ids = ids[:4, :prompt]
            with harness.bitsandbytes_patched(matmul=True):
                tokens = split.generate(prompt_ids, **kwargs), model.generate(prompt_ids, **kwargs)
            assert torch.equal(tokens[0].cpu(), tokens[1].cpu()), "matmul mode, split greedy generate"
    finally:
        del split
        torch.cuda.empty_cache()
