"""The registration, hook and gate tests again, against a real ``tensorrt_llm`` (skipped when it does not import).

These are the model tests' counterparts that can run without a GPU model checkpoint; the full
forward is covered end to end in ``test_e2e_qwen3.py``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from beam_shared_prefix._autoload import REGISTRY_MODULES
from beam_shared_prefix.trtllm import register
from beam_shared_prefix.trtllm.registration import exact_list_that_works

pytestmark = pytest.mark.trtllm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB = "beam_shared_prefix"


def real_registry():
    for name in REGISTRY_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise AssertionError(f"tensorrt_llm imports but has none of {REGISTRY_MODULES}")


def test_real_registration(monkeypatch, caplog):
    """Doc 1.1/1.4: in place, before fallback, DEFAULT_FMHA_LIBS untouched; '+' works or the warning
    gives the exact list, which works."""
    registry = real_registry()
    libs, default = registry.FMHA_LIBS, registry.DEFAULT_FMHA_LIBS
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    with caplog.at_level(logging.WARNING, logger="beam_shared_prefix.trtllm"):
        names = register()
    assert registry.__name__ in names
    assert registry.FMHA_LIBS is libs and registry.DEFAULT_FMHA_LIBS is default and LIB not in default
    order = list(libs)
    assert order.index(LIB) == order.index("fallback") - 1
    by_class = {cls: name for name, cls in libs.items()}
    enabled = [by_class[c] for c in registry.get_enabled_fmha_lib_classes()]
    if enabled.index(LIB) > enabled.index("fallback"):
        exact = exact_list_that_works(enabled)
        assert f"TLLM_FMHA_LIBS={exact}" in caplog.text
        monkeypatch.setenv("TLLM_FMHA_LIBS", exact)
        enabled = [by_class[c] for c in registry.get_enabled_fmha_lib_classes()]
    assert enabled.index(LIB) < enabled.index("fallback")


def test_real_class_contract():
    """Doc 2.1/2.2: a subclass of the installed tree's PhasedFmha (or Fmha) with the hooks overridden;
    it does not claim block-sparse support (doc 1.4: upstream tests assert that)."""
    registry = real_registry()
    register()
    cls = registry.FMHA_LIBS[LIB]
    package = registry.__name__.rsplit(".", 1)[0]
    base = getattr(importlib.import_module(package + ".phased"), "PhasedFmha", None) or importlib.import_module(
        package + ".interface"
    ).Fmha
    assert issubclass(cls, base)
    for name in ("_is_available", "_is_supported", "forward", "run_generation"):
        assert getattr(cls, name) is not getattr(base, name, None), name
    assert not getattr(cls, "supports_block_sparse_inputs", False)


def test_real_prepare_hook():
    """Doc 1.5/3.8: TrtllmAttentionMetadata.prepare is wrapped (once) by the hook."""
    from beam_shared_prefix.trtllm.planning import ensure_prepare_hook

    registry = real_registry()
    register()
    cls = registry.FMHA_LIBS[LIB]
    ensure_prepare_hook(cls)
    ensure_prepare_hook(cls)
    trtllm = importlib.import_module(registry.__name__.rsplit(".", 2)[0] + ".trtllm")
    prepare = trtllm.TrtllmAttentionMetadata.prepare
    assert getattr(prepare, "_beam_shared_prefix_wrapped", False)
    assert not getattr(prepare.__wrapped_original__, "_beam_shared_prefix_wrapped", False)


WORKER = textwrap.dedent(
    """
    import importlib, json, site, sys
    site.addsitedir(sys.argv[1])
    for name in sys.argv[2:]:
        try:
            registry = importlib.import_module(name)
            break
        except ModuleNotFoundError:
            continue
    print(json.dumps(list(registry.FMHA_LIBS)))
    """
)


def test_real_worker_process_autoload(tmp_path):
    """Doc 1.3: a fresh process with only TLLM_FMHA_LIBS set registers when TensorRT-LLM's registry loads."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "beam_shared_prefix_autoload.pth"), site_dir)
    env = dict(os.environ, TLLM_FMHA_LIBS=f"+{LIB}", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(site_dir), *REGISTRY_MODULES], env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    libs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert libs.index(LIB) == libs.index("fallback") - 1


@pytest.mark.gpu
def test_real_layer_gates(monkeypatch):
    """Doc 2.1/6.3 on a real TrtllmAttention: a dense GQA layer with RoPE applied by the module gets the
    library; head size 96 does not."""
    registry = real_registry()
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    register()
    trtllm = importlib.import_module(registry.__name__.rsplit(".", 2)[0] + ".trtllm")
    served = trtllm.TrtllmAttention(0, 16, 128, 8)
    names = [type(f).__name__ for f in served._fmha_manager.fmha_libs]
    assert "BeamSharedPrefixFmha" in names, names
    declined = trtllm.TrtllmAttention(1, 16, 96, 8)
    assert "BeamSharedPrefixFmha" not in [type(f).__name__ for f in declined._fmha_manager.fmha_libs]


def test_real_position_embedding_types():
    """Every positional embedding of the real ``PositionEmbeddingType`` but ``learned_absolute`` is one the
    backend applies, enum or int; and an int ``quant_mode`` reads through the real ``QuantMode``."""
    from tensorrt_llm.functional import PositionEmbeddingType
    from tensorrt_llm.quantization.mode import QuantMode

    from beam_shared_prefix.trtllm.gates import _position_embedding_in_backend, _quant_mode

    for member in PositionEmbeddingType:
        for value in (member, int(member)):
            applied = _position_embedding_in_backend(type("Layer", (), {"position_embedding_type": value})())
            assert (applied is None) == (member == PositionEmbeddingType.learned_absolute), (member, value)
    assert not _quant_mode(0).has_kv_cache_quant()
    assert _quant_mode(int(QuantMode.INT8_KV_CACHE)).has_kv_cache_quant()
