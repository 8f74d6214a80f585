"""patch_bitsandbytes(compiled_decode=True): transformers may compile bitsandbytes 4-bit models'
decode while the patch is in place, refused where it is not proven. The mechanics, on stand-ins
for transformers' two classes (CPU); transformers' own compiled decode is checked on the GPU
(tests/test_compiled_decode_gpu.py)."""

from __future__ import annotations

import re
import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch

import harness
from harness.runtime import compiled_decode, patch


class _Quantizer:
    @property
    def is_compileable(self) -> bool:
        return False


@pytest.fixture
def transformers_like(monkeypatch, bnb):
    """Stand-ins for transformers' 4-bit quantizer and generation mixin, as the seams name them:
    the quantizer inherits is_compileable (False); the mixin compiles where the quantizer lets it
    and the cache is static."""
    quantizers, generation = types.ModuleType("_quantizers_like"), types.ModuleType("_generation_like")

    class Bnb4BitHfQuantizer(_Quantizer):
        pass

    class GenerationMixin:
        def _valid_auto_compile_criteria(self, model_kwargs, generation_config):
            return model_kwargs["static"] and (self.hf_quantizer is None or self.hf_quantizer.is_compileable)

    quantizers.Bnb4BitHfQuantizer, generation.GenerationMixin = Bnb4BitHfQuantizer, GenerationMixin
    for module in (quantizers, generation):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(compiled_decode, "QUANTIZER_MODULE", quantizers.__name__)
    monkeypatch.setattr(compiled_decode, "GENERATION_MODULE", generation.__name__)
    yield Bnb4BitHfQuantizer, GenerationMixin
    patch.unpatch_bitsandbytes()


def _model(mixin, quantizer, devices=("cuda:0",), module_of_a_layer="torch.nn"):
    """A model as the criteria see it: its quantizer, its tensors' devices and its modules' types."""
    layer = type("Layer", (), {"__module__": module_of_a_layer})()
    tensors = [SimpleNamespace(device=torch.device(d)) for d in devices]
    model = mixin()
    model.hf_quantizer = quantizer
    model.parameters, model.buffers, model.modules = (lambda: iter(tensors)), (lambda: iter(())), (lambda: [layer])
    return model


def test_the_patch_lets_transformers_compile_a_4bit_model_and_unpatching_restores_its_own(transformers_like):
    quantizer_class, mixin = transformers_like
    own_criteria = mixin.__dict__["_valid_auto_compile_criteria"]
    model = _model(mixin, quantizer_class())
    assert not model._valid_auto_compile_criteria({"static": True}, None)
    assert harness.patch_bitsandbytes(matmul=True, compiled_decode=True)
    assert compiled_decode.installed() and quantizer_class().is_compileable
    assert model._valid_auto_compile_criteria({"static": True}, None)
    assert not model._valid_auto_compile_criteria({"static": False}, None), "transformers' own criteria still rule"
    harness.patch_bitsandbytes(matmul=True)  # the same patch without compiled decode
    assert not compiled_decode.installed() and not quantizer_class().is_compileable
    assert "is_compileable" not in quantizer_class.__dict__, "the inherited property is back"
    assert mixin.__dict__["_valid_auto_compile_criteria"] is own_criteria
    with harness.bitsandbytes_patched(compiled_decode=True):
        assert quantizer_class().is_compileable
    assert not compiled_decode.installed() and patch.is_patched(), "the block's mode is undone, the patch kept"
    harness.unpatch_bitsandbytes()
    assert not quantizer_class().is_compileable


@pytest.mark.parametrize(
    ("devices", "module", "why"),
    [
        (("cuda:0", "cpu"), "torch.nn", "tensors on ['cpu', 'cuda:0']"),
        (("cuda:0", "cuda:1"), "torch.nn", "split over ['cuda:0', 'cuda:1']"),
        (("cuda:0",), "peft.tuners.lora.bnb", "peft adapters"),
    ],
    ids=["cpu-offload", "two-gpus", "peft"],
)
def test_a_model_compiled_decode_is_not_proven_on_decodes_eager_with_a_warning(transformers_like, devices, module, why):
    quantizer_class, mixin = transformers_like
    harness.patch_bitsandbytes(compiled_decode=True)
    model = _model(mixin, quantizer_class(), devices, module)
    with pytest.warns(RuntimeWarning, match=f"compiled decode refused for this 4-bit model .*{re.escape(why)}"):
        assert not model._valid_auto_compile_criteria({"static": True}, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where transformers would not compile anyway
        assert not model._valid_auto_compile_criteria({"static": False}, None)
        # A model without a 4-bit quantizer is transformers' business alone.
        assert _model(mixin, None, devices, module)._valid_auto_compile_criteria({"static": True}, None)


def test_without_transformers_compiled_decode_warns_and_the_rest_is_patched(monkeypatch, bnb):
    monkeypatch.setattr(compiled_decode, "QUANTIZER_MODULE", "_no_such_transformers_module")
    try:
        with pytest.warns(RuntimeWarning, match="no compiled decode: transformers' 4-bit quantizer"):
            assert harness.patch_bitsandbytes(compiled_decode=True)
        assert patch.is_patched() and not compiled_decode.installed()
    finally:
        patch.unpatch_bitsandbytes()


def test_unpatching_or_a_mode_change_drops_the_decode_steps_compiled_under_the_patch(transformers_like, monkeypatch):
    """A compiled step replays the kernels it captured: after the patch goes or changes mode, the
    models compiled under it must compile again (or decode eager), never replay the old mode."""
    quantizer_class, mixin = transformers_like
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    compiled, refused = _model(mixin, quantizer_class()), _model(mixin, quantizer_class(), ("cpu",))
    harness.patch_bitsandbytes(matmul=True, compiled_decode=True)
    assert compiled._valid_auto_compile_criteria({"static": True}, None)
    with pytest.warns(RuntimeWarning):
        assert not refused._valid_auto_compile_criteria({"static": True}, None)
    compiled._compiled_call = refused._compiled_call = "a compiled step"
    harness.patch_bitsandbytes(matmul=False, compiled_decode=True)  # another mode
    assert not hasattr(compiled, "_compiled_call") and resets == [1]
    assert refused._compiled_call == "a compiled step", "only the models compiled under the patch"
    assert compiled._valid_auto_compile_criteria({"static": True}, None)
    compiled._compiled_call = "compiled again"
    harness.unpatch_bitsandbytes()
    assert not hasattr(compiled, "_compiled_call") and resets == [1, 1]
    harness.unpatch_bitsandbytes()  # nothing compiled under a patch now: no reset
    assert resets == [1, 1]
