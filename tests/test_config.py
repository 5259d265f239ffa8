"""Environment settings: defaults, every accepted value, and clear errors for the rest."""

import pytest

from beam_shared_prefix.config import (
    BACKENDS,
    DECLINE_MODES,
    ENV_BACKEND,
    ENV_CHECK,
    ENV_DECLINE,
    ENV_MAX_TAIL,
    ENV_REPORT_ERRORS,
    ENV_SHARED_RUN,
    SHARED_RUN_MODES,
    ConfigError,
    Settings,
    load_settings,
    shared_run_mode,
    triton_interpret_env,
    unknown_variables,
)


def test_defaults_from_empty_env():
    assert load_settings({}) == Settings(backend="auto", check=False, decline="auto", report_errors=False,
                                         shared_run="auto")


def test_blank_values_mean_default():
    env = {ENV_BACKEND: "  ", ENV_CHECK: "", ENV_DECLINE: "", ENV_SHARED_RUN: " "}
    assert load_settings(env) == Settings()


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "reference")
    monkeypatch.setenv(ENV_CHECK, "1")
    monkeypatch.delenv(ENV_DECLINE, raising=False)
    monkeypatch.setenv(ENV_REPORT_ERRORS, "1")
    monkeypatch.setenv(ENV_SHARED_RUN, "1")
    assert load_settings() == Settings(backend="reference", check=True, decline="auto", report_errors=True,
                                       shared_run="on")


@pytest.mark.parametrize("value", BACKENDS)
def test_each_backend_accepted(value):
    assert load_settings({ENV_BACKEND: value}).backend == value
    # Case and surrounding blanks do not matter.
    assert load_settings({ENV_BACKEND: f" {value.upper()} "}).backend == value


@pytest.mark.parametrize("value", DECLINE_MODES)
def test_each_decline_mode_accepted(value):
    assert load_settings({ENV_DECLINE: value}).decline == value
    assert load_settings({ENV_DECLINE: value.capitalize()}).decline == value


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False),
])
def test_flag_values(value, expected):
    assert load_settings({ENV_CHECK: value}).check is expected
    assert load_settings({ENV_REPORT_ERRORS: value}).report_errors is expected
    # The shared-run stage takes the same words for on and off; blank is its default, auto.
    assert load_settings({ENV_SHARED_RUN: value}).shared_run == ("on" if expected else "off" if value else "auto")


@pytest.mark.parametrize("value,expected", [("auto", "auto"), (" AUTO ", "auto"), (True, "on"), ("on", "on"),
                                            ("1", "on"), (False, "off"), ("off", "off"), ("0", "off")])
def test_shared_run_modes(value, expected):
    assert expected in SHARED_RUN_MODES
    assert shared_run_mode(value) == expected
    if isinstance(value, str):
        assert load_settings({ENV_SHARED_RUN: value}).shared_run == expected


@pytest.mark.parametrize("value", ["2", "sometimes", ""])
def test_invalid_shared_run(value):
    with pytest.raises(ValueError, match=r"shared_run=.* is not accepted; use 'auto'"):
        shared_run_mode(value)
    if value.strip():
        with pytest.raises(ConfigError, match=rf"{ENV_SHARED_RUN}='{value}' is not accepted; use auto"):
            load_settings({ENV_SHARED_RUN: value})


def test_accepted_values_are_documented():
    import beam_shared_prefix.config as config

    for value in BACKENDS + DECLINE_MODES + ("auto",):
        assert f"``{value}``" in config.__doc__, f"{value} missing from the settings table"
    for name in (ENV_BACKEND, ENV_CHECK, ENV_DECLINE, ENV_REPORT_ERRORS, ENV_SHARED_RUN, ENV_MAX_TAIL):
        assert f"``{name}``" in config.__doc__


@pytest.mark.parametrize("value", ["flash", "cutlass", "fa3", "auto,fa4"])
def test_invalid_backend(value):
    with pytest.raises(ConfigError) as e:
        load_settings({ENV_BACKEND: value})
    msg = str(e.value)
    assert msg.startswith(f"{ENV_BACKEND}={value!r} is not accepted")
    assert "use one of: auto, triton, flashinfer, fa4, reference (default auto)" in msg


@pytest.mark.parametrize("value", ["always", "0"])
def test_invalid_decline(value):
    with pytest.raises(ConfigError, match=rf"{ENV_DECLINE}='{value}' is not accepted; use one of: auto, never"):
        load_settings({ENV_DECLINE: value})


@pytest.mark.parametrize("value", ["2", "maybe", "enabled"])
def test_invalid_check_flag(value):
    with pytest.raises(ConfigError, match=rf"{ENV_CHECK}='{value}' is not accepted; use 1 \(on\) or 0 \(off\)"):
        load_settings({ENV_CHECK: value})


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), (" ", None), ("8", 8), (" 17 ", 17), ("1", 1)])
def test_max_tail(value, expected):
    env = {} if value is None else {ENV_MAX_TAIL: value}
    assert load_settings(env).max_tail_len == expected


@pytest.mark.parametrize("value", ["0", "-4", "8.5", "short", "\u00b2", "4\u00b2", "\u0664"])
def test_invalid_max_tail(value):
    with pytest.raises(ConfigError, match=rf"{ENV_MAX_TAIL}='{value}' is not accepted; use an integer >= 1"):
        load_settings({ENV_MAX_TAIL: value})


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), (" ON ", True), ("Yes", True), ("0", False),
                                            ("false", False), ("2", False), ("", False)])
def test_triton_interpret_is_read_as_triton_reads_it(value, expected):
    """The library's choice of the fused tail on CPU tensors follows Triton's own reading of the variable (an
    ``=true`` the library took for on and the kernels' launchers for off made run() fail)."""
    assert triton_interpret_env({"TRITON_INTERPRET": value}) is expected


def test_the_kernels_agree_with_the_variable():
    """The launchers ask the kernel object whether ``triton.jit`` made it an interpreted function; under this suite
    (``TRITON_INTERPRET=1`` on a machine without CUDA) the two readings agree."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the interpreter is off on a CUDA machine")
    from triton_kernels.cascade_kernel import beam_cascade_kernel
    from triton_kernels.step_args import runs_interpreted
    from triton_kernels.tail_merge_kernel import beam_tail_merge_kernel

    assert runs_interpreted(beam_tail_merge_kernel) and runs_interpreted(beam_cascade_kernel)
    assert triton_interpret_env()


def test_only_the_named_fields_are_read():
    """The plan/run wrapper reads only the settings it was not given (it has no use for the decline mode), so
    an invalid value elsewhere does not stop a direct caller; a named invalid one still raises."""
    env = {ENV_DECLINE: "bogus", ENV_BACKEND: "triton"}
    assert load_settings(env, fields=["backend"]) == Settings(backend="triton")
    with pytest.raises(ConfigError, match=ENV_DECLINE):
        load_settings(env)


def test_the_wrapper_reads_only_what_it_was_not_given(monkeypatch):
    from beam_shared_prefix import BeamSharedPrefixAttention

    monkeypatch.setenv(ENV_DECLINE, "bogus")
    monkeypatch.setenv(ENV_SHARED_RUN, "bogus")
    assert BeamSharedPrefixAttention("cpu", shared_run="off").requested_backend in BACKENDS
    with pytest.raises(ConfigError, match=ENV_SHARED_RUN):
        BeamSharedPrefixAttention("cpu")


@pytest.mark.parametrize("name, hint", [
    ("TLLM_BEAM_SHARED_PREFIX_DECLINES", "did you mean TLLM_BEAM_SHARED_PREFIX_DECLINE?"),
    ("TLLM_BEAM_SHARED_PREFIX_MAXTAIL", "did you mean TLLM_BEAM_SHARED_PREFIX_MAX_TAIL?"),
    ("TLLM_BEAM_SHARED_PREFIX_REPORT_ERROR", "did you mean TLLM_BEAM_SHARED_PREFIX_REPORT_ERRORS?"),
    ("TLLM_BEAM_SHARED_PREFIX_WORKSPACE", f"the library reads {ENV_BACKEND}, "),
])
def test_a_misspelt_variable_is_named(name, hint):
    """A variable with the library's prefix that it does not read leaves its setting at the default: it is named,
    with the closest variable the library reads; the variables it reads, and others, are not."""
    env = {name: "1", ENV_DECLINE: "never", ENV_MAX_TAIL: "4", "TLLM_FMHA_LIBS": "+beam_shared_prefix"}
    (line,) = unknown_variables(env)
    assert line.startswith(f"{name} is not a setting of this library and is ignored; {hint}"), line
