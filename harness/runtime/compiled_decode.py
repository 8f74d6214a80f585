"""transformers' compiled decode for bitsandbytes 4-bit models, while the patch is in place.

``generate(cache_implementation="static")`` compiles the decode step (``torch.compile``, mode
"reduce-overhead": CUDA graphs, not fullgraph) only where the model's quantizer says
``is_compileable``; bitsandbytes' 4-bit quantizer keeps the base class's False, so for these models
transformers silently decodes eager. Both of the patch's modes compile and replay there (the
default mode runs bitsandbytes' own ops, matmul mode our registered op:
``tests/test_compiled_decode_gpu.py``), so ``patch_bitsandbytes(compiled_decode=True)`` installs:

- ``Bnb4BitHfQuantizer.is_compileable``: True while the patch is in place, restored when it goes;
- a check of each model that transformers would compile: a model with parameters on the CPU or on
  several GPUs, or with peft adapters, is refused (``refusal``): it decodes eager as before, with a
  ``RuntimeWarning`` naming why. Compiled decode is not proven there, and a wrong result is worse
  than a slow one.

A compiled decode step replays the kernels its CUDA graphs captured, whatever the patch is later:
a step compiled in matmul mode would go on running the fused kernel after an unpatch. So when the
patch goes or changes mode, the models compiled under it lose their compiled step
(``_compiled_call``, transformers' cache of it) and torch.compile's caches are reset: their next
``generate`` compiles again in the mode then in place, or decodes eager.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
import weakref

QUANTIZER_MODULE, QUANTIZER = "transformers.quantizers.quantizer_bnb_4bit", "Bnb4BitHfQuantizer"
GENERATION_MODULE, GENERATION = "transformers.generation.utils", "GenerationMixin"
CRITERIA = "_valid_auto_compile_criteria"  # the method that decides whether generate compiles

# While installed: the quantizer class, what its own __dict__ held for is_compileable (_NOT_OWN:
# it inherited the base class's), the generation mixin and its own criteria function.
_installed: dict = {}
_NOT_OWN = object()
# The models transformers was let compile while installed (weakly: a model may go away).
_compiled_models: weakref.WeakSet = weakref.WeakSet()


def refusal(model) -> str | None:
    """Why compiled decode is not offered for ``model``, or None: the whole model on one CUDA GPU
    and no peft adapter in it."""
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    names = sorted(str(d) for d in devices)
    if any(d.type != "cuda" for d in devices):
        return f"the model has tensors on {names}: compiled decode needs it all on one CUDA GPU"
    if len(devices) > 1:
        return f"the model is split over {names}: compiled decode needs it on one GPU"
    if any(type(m).__module__.split(".")[0] == "peft" for m in model.modules()):
        return "the model holds peft adapters"
    return None


def _criteria_wrapper(original, quantizer_class):
    @functools.wraps(original)
    def _valid_auto_compile_criteria(self, model_kwargs, generation_config):
        allowed = original(self, model_kwargs, generation_config)
        if allowed and isinstance(getattr(self, "hf_quantizer", None), quantizer_class):
            if (why := refusal(self)) is not None:
                warnings.warn(
                    f"harness: transformers' compiled decode refused for this 4-bit model ({why}); it decodes eager",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return False
            _compiled_models.add(self)
        return allowed

    return _valid_auto_compile_criteria


def install() -> str | None:
    """Make bitsandbytes' 4-bit models compileable for transformers' decode; None when in place,
    else why not (transformers missing, or not the classes this was proven on)."""
    if _installed:
        return None
    try:
        quantizer_class = getattr(importlib.import_module(QUANTIZER_MODULE), QUANTIZER)
        mixin = getattr(importlib.import_module(GENERATION_MODULE), GENERATION)
    except (ImportError, AttributeError) as e:
        return f"transformers' 4-bit quantizer or generation mixin is not there ({e})"
    criteria = mixin.__dict__.get(CRITERIA)
    if criteria is None or not isinstance(inspect.getattr_static(quantizer_class, "is_compileable", None), property):
        return f"{GENERATION}.{CRITERIA} or the property {QUANTIZER}.is_compileable is missing"
    _installed.update(
        quantizer=quantizer_class,
        own=quantizer_class.__dict__.get("is_compileable", _NOT_OWN),
        mixin=mixin,
        criteria=criteria,
    )
    quantizer_class.is_compileable = property(lambda self: True, doc="True while harness' compiled decode is on")
    setattr(mixin, CRITERIA, _criteria_wrapper(criteria, quantizer_class))
    return None


def uninstall() -> None:
    """Put transformers' own quantizer property and criteria back. Harmless when not installed."""
    if not _installed:
        return
    quantizer_class, own = _installed["quantizer"], _installed["own"]
    if own is _NOT_OWN:
        del quantizer_class.is_compileable
    else:
        quantizer_class.is_compileable = own
    setattr(_installed["mixin"], CRITERIA, _installed["criteria"])
    _installed.clear()
    _drop_compiled_steps()


def _drop_compiled_steps() -> None:
    """Forget the decode steps compiled while installed (see the module's docstring)."""
    models = list(_compiled_models)
    _compiled_models.clear()
    for model in models:
        model.__dict__.pop("_compiled_call", None)
    if models:
        import torch

        torch._dynamo.reset()


def installed() -> bool:
    return bool(_installed)
