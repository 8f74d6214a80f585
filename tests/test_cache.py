"""The on-disk cubin cache: what its key covers, reuse, repair, and concurrent writers."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import shutil

import pytest

from harness import settings
from harness.runtime import dequantize_kernel, jit
from harness.runtime.dequantize_kernel import KernelVariant


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def src(tmp_path):
    """A private copy of the kernels directory, so tests can edit sources and headers."""
    d = tmp_path / "kernels"
    shutil.copytree(jit.kernels_dir(), d)
    (d / "extra.cuh").write_text("#define EXTRA 1\n")
    text = (d / "dequantize_4bit.cu").read_text()
    (d / "dequantize_4bit.cu").write_text('#include "extra.cuh"\n' + text)
    return d


def _spec(src, **changes):
    base = dequantize_kernel.spec_for(KernelVariant("nf4", "fp16", True), "sm_90")
    return dataclasses.replace(base, source=src / "dequantize_4bit.cu", **changes)


def test_every_input_changes_the_key(src, monkeypatch):
    base = _spec(src)
    key = base.key
    variants = {
        "arch": _spec(src, arch="sm_80").key,
        "macro value": _spec(src, macros=KernelVariant("nf4", "fp16", True, unroll=2).macros()).key,
        "extra macro": _spec(src, macros=(*base.macros, ("X", "1"))).key,
        "option": _spec(src, options=(*base.options, "--maxrregcount=64")).key,
        "option value": _spec(src, options=tuple(o.replace("fmad=false", "fmad=true") for o in base.options)).key,
    }
    (src / "dequantize_4bit.cu").write_text((src / "dequantize_4bit.cu").read_text() + "\n// edit\n")
    variants["source text"] = base.key
    (src / "extra.cuh").write_text("#define EXTRA 2\n")
    variants["included header"] = base.key
    monkeypatch.setattr(jit, "nvrtc_version", lambda: "99.9")
    variants["nvrtc version"] = base.key
    monkeypatch.setattr(jit, "CACHE_SCHEMA", jit.CACHE_SCHEMA + 1)
    variants["cache schema"] = base.key
    keys = [key, *variants.values()]
    assert len(set(keys)) == len(keys), {k: v[:12] for k, v in variants.items()}


def test_every_codegen_argument_changes_the_artifact_name():
    names = {
        dequantize_kernel.spec_for(v, "sm_90").artifact_stem()
        for v in [
            KernelVariant(q, d, n, t, u)
            for q in ("nf4", "fp4")
            for d in ("fp16", "bf16", "fp32")
            for n in (False, True)
            for t in (128, 256)
            for u in (2, 4)
        ]
    }
    assert len(names) == 2 * 3 * 2 * 2 * 2


def test_key_is_stable_for_identical_inputs(src):
    assert _spec(src).key == _spec(src).key


def test_second_compile_is_a_cache_hit(cache, src):
    first = jit.compile_kernel(_spec(src))
    second = jit.compile_kernel(_spec(src))
    assert not first.from_cache and second.from_cache
    assert first.cubin == second.cubin and first.resources == second.resources
    meta = json.loads(first.path.with_suffix(".json").read_text())
    assert meta["key"] == first.spec_key and meta["key_material"]["arch"] == "sm_90"
    assert first.path.parent.name == "sm_90" and first.path.parent.parent.name.startswith("nvrtc-")


@pytest.mark.parametrize("damage", ["truncate cubin", "garbage metadata", "delete metadata", "wrong key"])
def test_damaged_entry_is_rebuilt(cache, src, damage):
    first = jit.compile_kernel(_spec(src))
    meta_path = first.path.with_suffix(".json")
    if damage == "truncate cubin":
        first.path.write_bytes(first.cubin[:100])
    elif damage == "garbage metadata":
        meta_path.write_text("{not json")
    elif damage == "delete metadata":
        meta_path.unlink()
    else:
        meta = json.loads(meta_path.read_text())
        meta["key"] = "0" * 64
        meta_path.write_text(json.dumps(meta))
    again = jit.compile_kernel(_spec(src))
    assert not again.from_cache and again.cubin == first.cubin
    assert jit.compile_kernel(_spec(src)).from_cache


def _worker(args):
    cache_dir, src_dir = args
    import os

    os.environ[settings.CACHE_DIR.name] = cache_dir
    from pathlib import Path

    return jit.compile_kernel(_spec(Path(src_dir))).from_cache


def test_parallel_workers_compile_once(cache, src):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        hits = pool.map(_worker, [(str(cache), str(src))] * 8)
    assert hits.count(False) == 1, hits
    assert not list(cache.rglob("*.tmp"))
