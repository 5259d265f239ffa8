"""Registration in TensorRT-LLM's FMHA registry, settings at start-up, and the start-up hook.

Against the interface model (``interface_model.py``, a model of the facts in
``trtllm-interfaces.md``, not TensorRT-LLM); each test names the section its behaviour comes from.
``test_real_trtllm.py`` repeats the registry checks against a real ``tensorrt_llm`` when one imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from beam_shared_prefix import _autoload
from beam_shared_prefix.config import ConfigError
from beam_shared_prefix.trtllm import register
from interface_model import REGISTRY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
LIB = "beam_shared_prefix"
LAYOUTS = ["new", "old"]


def enabled_names(registry):
    """Names of the classes TensorRT-LLM would instantiate (doc 1.2/1.3)."""
    by_class = {cls: name for name, cls in registry.FMHA_LIBS.items()}
    return [by_class[cls] for cls in registry.get_enabled_fmha_lib_classes()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_register_inserts_before_fallback_in_place(trt, layout):
    """Doc 1.1/1.4: FMHA_LIBS mutated in place (the fmha package re-export sees it), the entry sits right
    before fallback, the other entries keep their order, DEFAULT_FMHA_LIBS stays the same tuple (opt-in)."""
    model = trt(layout=layout)
    registry = model.registry
    libs, default = registry.FMHA_LIBS, registry.DEFAULT_FMHA_LIBS
    before = list(libs)
    assert register() == [REGISTRY[layout]]
    assert registry.FMHA_LIBS is libs and model.module(".fmha").FMHA_LIBS is libs
    names = list(libs)
    assert names == before[:-1] + [LIB, "fallback"]
    assert registry.DEFAULT_FMHA_LIBS is default and LIB not in default
    cls = libs[LIB]
    assert issubclass(cls, model.module(".fmha.phased").PhasedFmha)
    register()  # idempotent
    assert list(libs) == names and libs[LIB] is cls


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delta_form_with_canonical_order(trt, layout, monkeypatch):
    """Doc 1.2 (new-layout semantics): `+name` is emitted in FMHA_LIBS order, so before fallback."""
    model = trt(layout=layout, plus="canonical")
    register()
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    names = enabled_names(model.registry)
    assert names[-2:] == [LIB, "fallback"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_semantics_warns_with_the_exact_list(trt, layout, monkeypatch, caplog):
    """Doc 1.2 (old-layout semantics): `+name` lands after fallback; registration says so and prints
    the exact list, which does put the library before fallback."""
    model = trt(layout=layout, plus="append")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    with caplog.at_level(logging.WARNING, logger="beam_shared_prefix.trtllm"):
        register()
    registry = model.registry
    assert enabled_names(registry)[-2:] == ["fallback", LIB]  # the problem
    defaults = [n for n in registry.DEFAULT_FMHA_LIBS]
    exact = ",".join(defaults[:-1] + [LIB, "fallback"])
    assert f"TLLM_FMHA_LIBS={exact}" in caplog.text
    monkeypatch.setenv("TLLM_FMHA_LIBS", exact)
    assert enabled_names(registry)[-2:] == [LIB, "fallback"]


@pytest.mark.parametrize("libs", [LIB, f"+{LIB},-fallback"], ids=["exact-list-without-fallback", "minus-fallback"])
def test_a_list_without_fallback_warns_with_the_exact_list(trt, monkeypatch, caplog, libs):
    """The library serves generation rows only: a list that enables it without ``fallback`` leaves every context-only
    batch without a library, and TensorRT-LLM's own error at the first prefill does not name the cause. Registration
    does, with the list that works."""
    model = trt(layout="new", plus="canonical")
    monkeypatch.setenv("TLLM_FMHA_LIBS", libs)
    with caplog.at_level(logging.WARNING, logger="beam_shared_prefix.trtllm"):
        register()
    assert "fallback" not in enabled_names(model.registry)  # the problem
    assert f"enables {LIB} but not 'fallback'" in caplog.text
    exact = caplog.text.split("TLLM_FMHA_LIBS=")[-1].split()[0]
    monkeypatch.setenv("TLLM_FMHA_LIBS", exact)
    assert enabled_names(model.registry)[-2:] == [LIB, "fallback"]


def test_a_misspelt_setting_is_named_at_registration(trt, monkeypatch, caplog):
    """A misspelt ``TLLM_BEAM_SHARED_PREFIX_*`` variable would leave its setting at the default without a word."""
    trt(layout="new", plus="canonical")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_DECLINES", "never")
    with caplog.at_level(logging.WARNING, logger="beam_shared_prefix.trtllm"):
        register()
    assert ("TLLM_BEAM_SHARED_PREFIX_DECLINES is not a setting of this library and is ignored; did you mean "
            "TLLM_BEAM_SHARED_PREFIX_DECLINE?") in caplog.text


def test_no_warning_when_order_is_right(trt, monkeypatch, caplog):
    """Doc 1.2: the canonical semantics need no advice."""
    trt(layout="new", plus="canonical")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    with caplog.at_level(logging.WARNING, logger="beam_shared_prefix.trtllm"):
        register()
    assert "exact list" not in caplog.text


@pytest.mark.parametrize("value", [None, "-beam_shared_prefix", "+prims_ts"])
def test_opt_in_default(trt, monkeypatch, value):
    """Doc 1.2/1.4: registered but not enabled unless named with '+' (or in an exact list)."""
    model = trt(layout="new")
    register()
    if value is not None:
        monkeypatch.setenv("TLLM_FMHA_LIBS", value)
    assert LIB not in enabled_names(model.registry)


def test_unregistered_name_is_rejected_by_trtllm(trt, monkeypatch):
    """Doc 1.2: TensorRT-LLM rejects an unknown name, which is why every model-building process must register."""
    model = trt(layout="new")
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    with pytest.raises(ValueError, match="Unknown FMHA library 'beam_shared_prefix'"):
        model.registry.get_enabled_fmha_lib_classes()


@pytest.mark.parametrize(
    "variable, value, accepted",
    [
        ("TLLM_BEAM_SHARED_PREFIX_BACKEND", "flashinfer2", "auto, triton, flashinfer, fa4, reference"),
        ("TLLM_BEAM_SHARED_PREFIX_CHECK", "maybe", "use 1 (on) or 0 (off)"),
        ("TLLM_BEAM_SHARED_PREFIX_DECLINE", "always", "auto, never"),
    ],
)
def test_invalid_setting_fails_at_start_up(trt, monkeypatch, variable, value, accepted):
    """Issue: invalid values raise at start-up (when the registry is imported) listing the accepted values."""
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    monkeypatch.setenv(variable, value)
    model = trt(layout="new")
    assert _autoload.install()
    with pytest.raises(ConfigError) as info:
        importlib.import_module(model.root + ".fmha.registry")
    assert variable in str(info.value) and repr(value) in str(info.value) and accepted in str(info.value)


@pytest.mark.parametrize("value", [None, "", "+prims_ts", "fallback", "beam_shared_prefix_v2"])
def test_autoload_does_nothing_unless_named(library_env, value):
    """The start-up hook is inert (no finder) when TLLM_FMHA_LIBS does not name the library."""
    env = {} if value is None else {"TLLM_FMHA_LIBS": value}
    assert _autoload.install(env) is False
    assert not _autoload.is_installed()


@pytest.mark.parametrize("value", ["+beam_shared_prefix", " -beam_shared_prefix ", "fallback, beam_shared_prefix"])
def test_autoload_names_library(value):
    assert _autoload.env_names_library({"TLLM_FMHA_LIBS": value})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_autoload_registers_when_the_registry_is_imported(trt, monkeypatch, layout):
    """Doc 1.3/1.4: the hook registers right after the registry module executes, before any layer exists."""
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    assert _autoload.install()
    model = trt(layout=layout)
    registry = importlib.import_module(model.root + ".fmha.registry")
    assert list(registry.FMHA_LIBS)[-2:] == [LIB, "fallback"]
    # The wrapped loader handed the module back its real loader (introspection sees the original).
    assert not type(registry.__loader__).__name__.startswith("_PostImport")


def test_autoload_registers_an_already_imported_registry(trt, monkeypatch):
    model = trt(layout="new")
    registry = model.registry
    assert LIB not in registry.FMHA_LIBS
    monkeypatch.setenv("TLLM_FMHA_LIBS", f"+{LIB}")
    assert _autoload.install()
    assert list(registry.FMHA_LIBS)[-2:] == [LIB, "fallback"]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="a real tensorrt_llm is installed")
def test_register_without_tensorrt_llm_names_both_paths(library_env):
    with pytest.raises(RuntimeError) as info:
        register()
    assert REGISTRY["new"] in str(info.value) and REGISTRY["old"] in str(info.value)


WORKER = textwrap.dedent(
    """
    import importlib, json, site, sys
    site.addsitedir(sys.argv[1])           # what site does for site-packages at start-up
    heavy_at_start_up = sorted({"torch", "numpy", "beam_shared_prefix"} & set(sys.modules))
    from beam_shared_prefix import _autoload
    hooked = _autoload.is_installed()
    from interface_model import TrtModel     # "TensorRT-LLM is installed" (the model)
    model = TrtModel(layout=sys.argv[2]).install()
    registry = importlib.import_module(model.root + ".fmha.registry")
    print(json.dumps({"heavy_at_start_up": heavy_at_start_up, "hooked": hooked, "libs": list(registry.FMHA_LIBS)}))
    """
)


def run_worker(tmp_path, layout, fmha_libs):
    """A fresh interpreter with only TLLM_FMHA_LIBS (plus PYTHONPATH to find the code) set."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "beam_shared_prefix_autoload.pth"), site_dir)
    env = {"PYTHONPATH": os.pathsep.join([ROOT, HERE])}
    if fmha_libs is not None:
        env["TLLM_FMHA_LIBS"] = fmha_libs
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(site_dir), layout], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_worker_process_autoload(tmp_path, layout):
    """Doc 1.3: worker processes build the model too; the .pth hook registers there with nothing but
    the variable set. At start-up it imports only the standard library (not even the package's
    ``__init__``, which needs numpy: site may process this .pth before other site dirs are on sys.path)."""
    result = run_worker(tmp_path, layout, f"+{LIB}")
    assert result["hooked"] and result["heavy_at_start_up"] == []
    assert result["libs"][-2:] == [LIB, "fallback"]


def test_worker_process_without_the_variable(tmp_path):
    result = run_worker(tmp_path, "new", None)
    assert not result["hooked"] and LIB not in result["libs"]


def test_build_puts_the_pth_at_the_top_of_site_packages(tmp_path):
    """setup.py's build_py copies the .pth into the root of the purelib tree (what a wheel installs into
    site-packages), where Python's site module runs it at every start-up."""
    src, build_lib = tmp_path / "src", tmp_path / "lib"
    # A copy of the project, so that setuptools' egg-info lands in tmp, not in the working tree.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".gpu", "tests", "build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build_lib)],
        cwd=src, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    pth = build_lib / "beam_shared_prefix_autoload.pth"
    assert pth.read_text() == open(os.path.join(ROOT, "beam_shared_prefix_autoload.pth")).read()
    assert (build_lib / "beam_shared_prefix" / "_autoload.py").exists()
