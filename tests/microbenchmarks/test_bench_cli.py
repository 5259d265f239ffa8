"""The CLI end to end on the CPU path (no GPU): messages, JSON, plot, decline report, exit codes."""

import json
import os

import pytest
import torch

from microbenchmarks import cli
from microbenchmarks.report import SCHEMA, audit_summary, decline_table, load_json, make_document, plot_speedups

ARM_KEYS = {"name", "kind", "work", "status", "reason", "graphed", "info", "check", "time_us", "time_set_medians_us",
            "speedup_vs_decode", "speedup_vs_cascade", "floor_multiple", "achieved_GBps", "achieved_TFLOPs"}


@pytest.fixture
def no_gpu(monkeypatch):
    """The CPU path even on a GPU machine: the CLI asks torch.cuda.is_available()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_preset_a_without_gpu_writes_json(no_gpu, tmp_path, capsys):
    path = tmp_path / "out" / "a.json"
    assert cli.main(["--preset", "A", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "No GPU" in text and "no CUDA GPU was found" in text and "reduced shape" in text
    doc = json.loads(path.read_text())  # strict JSON: no NaN/Infinity tokens
    assert doc["schema"] == SCHEMA
    assert set(doc) >= {"argv", "environment", "rates", "options", "note", "results"}
    assert doc["environment"]["gpu"] is False and doc["environment"]["cpu_fallback"] is True
    assert doc["rates"] == {"copy_bandwidth_GBps": None, "matmul_TFLOPs": None, "event_overhead_us": None}
    (point,) = doc["results"]
    assert point["shape"]["name"] == "A-cpu" and point["shape"]["heads"] == 16 and point["shape"]["kv_heads"] == 8
    assert point["shape"]["requests"] == 2 and point["shape"]["beams"] == 8
    assert set(point) >= {"traffic_bytes", "flops", "floors", "work", "arms", "plan", "decline_reason", "rule_paths",
                          "label"}
    assert point["rule_paths"] == {"eager": "cascade", "graph": "cascade"}
    names = [a["name"] for a in point["arms"]]
    assert names == ["library/reference+torch-tail", "prefix/reference", "tail/torch"]
    for arm in point["arms"]:
        assert arm["status"] == "ok", arm
        assert set(arm) >= ARM_KEYS
        assert arm["check"]["ok"] and arm["check"]["rows_checked"] == 2 * 2 * 8  # 2 sets x all 16 rows
        assert arm["time_us"] > 0 and arm["graphed"] is False
    assert point["arms"][1]["check"]["lse_max_abs_err"] is not None  # the prefix arm checks its LSE too
    plan = point["plan"]["library/reference+torch-tail"]
    assert plan["replan_us"] > 0 and plan["first_plan_us"] > 0 and plan["replan_keyed_us"] > 0
    assert plan["backend_plans_in_cached_replans"] == 0
    assert point["traffic_bytes"]["total"] > 0 and point["floors"]["floor_us"] is None
    assert doc["options"]["l2_flush"] == "read"  # the default, recorded with the results


@pytest.mark.parametrize("argv,mode", [([], "read"), (["--l2-flush", "write"], "write"), (["--no-flush-l2"], "none")])
def test_l2_flush_option_reaches_the_run_options(no_gpu, tmp_path, argv, mode):
    path = tmp_path / "a.json"
    assert cli.main(["--preset", "B-short", "--json", str(path), *argv]) == 0
    assert json.loads(path.read_text())["options"]["l2_flush"] == mode


def test_git_commit_can_be_named_by_the_environment(monkeypatch):
    monkeypatch.setenv("BEAM_SHARED_PREFIX_GIT_COMMIT", "abc1234")
    assert cli.environment("cpu", False, True)["git_commit"] == "abc1234"


def test_l2_flush_modes_read_write_or_skip_the_buffer():
    from microbenchmarks.timing import L2_FLUSH_MODES, L2Flush

    assert set(L2_FLUSH_MODES) == set(cli.build_parser()._option_string_actions["--l2-flush"].choices)
    read = L2Flush("read", 1 << 12, device="cpu")
    read()
    assert float(read._sum) == (1 << 12) // 4  # summed the whole buffer, left it intact
    assert torch.all(read.buffer == 1)
    write = L2Flush("write", 1 << 12, device="cpu")
    write()
    assert torch.all(write.buffer == 0)
    assert L2Flush("none", 1 << 12, device="cpu").buffer is None
    with pytest.raises(ValueError, match="'dirty' is not one of"):
        L2Flush("dirty")


def synthetic_doc():
    """A sweep document with made-up times (the plot and decline report read only these fields)."""
    results = []
    for beams, prompt, lib_us in [(14, 500, 120.0), (30, 500, 60.0), (96, 500, 70.0), (30, 100, 40.0), (30, 2000, 150.0)]:
        decode = 80.0 * beams / 30 * prompt / 500
        arms = [
            {"name": "library/flashinfer", "kind": "library", "status": "ok", "time_us": lib_us,
             "speedup_vs_decode": decode / lib_us},
            {"name": "fi-decode-tc", "kind": "baseline", "status": "ok", "time_us": decode, "speedup_vs_decode": 1.0},
        ]
        shape = dict(requests=64, beams=beams, prompt=prompt, tail=4, heads=16, kv_heads=8, head_dim=128)
        results.append({"shape": shape, "label": f"W{beams} P{prompt}", "arms": arms, "floors": {"floor_us": 30.0},
                        "decline_reason": None})
    return make_document(results, {"device": "test"}, {}, {}, ["x"])


def test_plot_has_a_panel_per_swept_field(tmp_path):
    path = tmp_path / "p.png"
    titles = plot_speedups(synthetic_doc(), str(path))
    assert titles == ["speedup vs beam width", "speedup vs prompt length (tokens)"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_series_split_by_every_swept_field():
    """A sweep of beams x ancestry (or x a jitter) draws one line per ancestry, not one zig-zag line."""
    from microbenchmarks.report import _series

    doc = synthetic_doc()
    doc["results"] = [dict(p, shape=dict(p["shape"], ancestry=a)) for p in doc["results"][:3]
                      for a in ("beam-search", "independent")]
    series = _series(doc, "beams")
    assert sorted(series) == ["library/flashinfer [ancestry=beam-search]", "library/flashinfer [ancestry=independent]"]
    assert all([x for x, _ in pts] == [14, 30, 96] for pts in series.values())


def test_decline_report_flags_points_slower_than_decode():
    rows = decline_table(synthetic_doc())
    # W14 P500: decode 80*14/30 = 37.3 us < 120 us -> decline; W30 P100: 16 us < 40 us -> decline.
    assert [(r["beams"], r["prompt"], r["decline"]) for r in rows] == [
        (14, 500, True), (30, 500, False), (96, 500, False), (30, 100, True), (30, 2000, False)]
    # The rule of the day the document was measured (recorded) beside today's.
    assert all(r["rule_says"] is None for r in rows)
    assert [r["rule_now"] is None for r in rows] == [True] * 5  # 64 x 14-96 beams, 4-token tails: all served


def test_audit_judges_the_rule_and_the_backend_choice():
    """Held-out points: a served point the library lost, a declined one it would have won, and auto's pick against the
    fastest library arm, each counted in the audit line with its ratio."""
    def point(requests, beams, prompt, auto_us, other_us, decode_us):
        arms = [{"name": name, "kind": "library", "status": "ok", "time_us": us, "speedup_vs_decode": decode_us / us,
                 "info": {"backend": backend}}
                for name, backend, us in (("library/auto", "triton", auto_us), ("library/fa4", "fa4", other_us))]
        arms.append({"name": "fi-decode-tc", "kind": "baseline", "status": "ok", "time_us": decode_us,
                     "speedup_vs_decode": 1.0})
        shape = {"requests": requests, "beams": beams, "prompt": prompt, "tail": 4, "heads": 16, "kv_heads": 8,
                 "head_dim": 128}
        return {"shape": shape, "label": "x", "arms": arms, "floors": {}, "decline_reason": None}

    doc = make_document([
        point(64, 30, 500, 60.0, 75.0, 690.0),  # served, auto the fastest
        point(64, 96, 500, 110.0, 100.0, 95.0),  # served, the fastest library arm 0.95x of decode, auto 1.10x it
        point(2, 8, 81, 30.0, 35.0, 45.0),  # declined (16 beam rows), the library 1.5x faster
    ], {"device": "test"}, {}, {}, ["x"])
    rows = decline_table(doc)
    assert [r["rule_now"] is None for r in rows] == [True, True, False]
    assert [r["auto_backend"] for r in rows] == ["triton"] * 3
    assert rows[0]["auto_over_best"] == 1.0 and rows[1]["auto_over_best"] == pytest.approx(1.1)
    assert audit_summary(rows) == (
        "audit over 3 measured points: served 2, 1 slower than per-beam decode (worst 0.95x); declined 1, 1 where the "
        "library was faster (up to 1.50x); auto within 1.05x of the fastest library arm at 1 of 2 served (worst 1.10x)")


def test_sample_replaces_the_preset_and_sweeps(capsys):
    """``--sample N`` gives N seeded shapes with the page size and ancestry asked for, of the models with the head
    size asked for; with a drawn shape field pinned it is an error naming the field."""
    args = cli.build_parser().parse_args(["--sample", "5", "--seed", "7", "--page-size", "16", "--head-dim", "64",
                                          "--ancestry", "independent"])
    shapes = cli.resolve_shapes(args)
    assert len(shapes) == 5 and {(s.page_size, s.head_dim, s.ancestry) for s in shapes} == {(16, 64, "independent")}
    assert [s.name for s in shapes] == [f"sample7.{i}" for i in range(5)]
    for argv, named in ((["--preset", "A"], "--preset"), (["--beams", "30"], "--beams"),
                        (["--sweep", "beams=14,30"], "--sweep")):
        with pytest.raises(SystemExit):
            cli.main(["--sample", "3", "--rule", *argv])
        assert f"--sample draws the shape; drop {named} (--head-dim picks the models" in capsys.readouterr().err
    assert cli.main(["--sample", "4", "--seed", "7", "--rule"]) == 0
    assert capsys.readouterr().out.count("sample7.") == 4


def test_from_json_renders_and_plots(no_gpu, tmp_path, capsys):
    src = tmp_path / "s.json"
    from microbenchmarks.report import write_json

    write_json(synthetic_doc(), str(src))
    write_json(synthetic_doc(), str(tmp_path / "s2.json"))  # another run of the same machine
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    rc = cli.main(["--from-json", str(src), "--from-json", str(tmp_path / "s2.json"), "--json", str(out_json),
                   "--plot", str(out_png), "--decline-report"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "DECLINE" in text and "serve" in text
    assert len(load_json(str(out_json))["results"]) == 10 and out_png.exists()


def test_oracle_mismatch_gives_exit_status_1(tmp_path, capsys):
    doc = synthetic_doc()
    doc["results"][0]["arms"][0].update(status="check_failed", reason="relative error 0.5 > tolerance 0.02")
    src = tmp_path / "bad.json"
    from microbenchmarks.report import write_json

    write_json(doc, str(src))
    assert cli.main(["--from-json", str(src)]) == 1
    assert "ORACLE CHECK FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--preset", "B-short", "--arms", "foo"], "--arms: unknown arm 'foo'"),
    (["--preset", "B-short", "--arms", ",,"], "names no arm"),
    (["--preset", "B-short", "--arms", "auto,decode,auto"], "names ['auto'] more than once"),
    (["--preset", "B-short", "--seed", "-1"], "--seed=-1 must be in [0, 2**63)"),
    (["--preset", "B-short", "--warmup", "-5"], "--warmup=-5 must be in [0, 100000]"),
    (["--preset", "B-short", "--plan-repeats", "-1"], "--plan-repeats=-1 must be in [0, 100000]"),
    (["--preset", "B-short", "--iters", "1000000000"], "--iters=1000000000 must be in [1, 100000]"),
    (["--preset", "B-short", "--json", "{tmp}"], "is a directory; give a file path"),
    (["--preset", "B-short", "--json", ""], "--json '': give a file path"),
    (["--preset", "B-short", "--plot", "{tmp}/speed.xyz"], "xyz is not an image type matplotlib writes"),
    (["--from-json", "{tmp}/missing.json"], "--from-json: [Errno 2] No such file or directory"),
    (["--sample", "1000000000", "--rule"], "--sample 1000000000 must be in [1, 10000]"),
    (["--e2e-model", "{tmp}", "--requests", "0"], "requests=0 must be an int >= 1"),
    (["--preset", "B-short", "--rule", "--json", "{tmp}/rule.json"], "--rule prints each shape's verdict and measures"),
    (["--beams", "8", "--sweep", "beams=16,32", "--rule"], "--beams given both as a flag and in --sweep"),
    (["--from-json", "{tmp}/x.json", "--preset", "B-long", "--arms", "decode"],
     "--from-json replays measured files; --preset, --arms would change nothing there"),
    (["--from-json", "{tmp}/x.json", "--sets", "5", "--prefix-kernels", "fa2", "--e2e-model", "{tmp}"],
     "--from-json replays measured files; --prefix-kernels, --sets, --e2e-model would change nothing there"),
    (["--preset", "B-short", "--no-flush-l2", "--l2-flush", "write"], "--no-flush-l2 with --l2-flush write"),
    (["--e2e-model", "{tmp}", "--heads", "32", "--plot", "{tmp}/e.png"],
     "--e2e-model runs the model's own attention shape; --heads, --plot would change nothing there"),
    (["--preset", "B-short", "--prefix-kernels", "fa2,fa9"], "--prefix-kernels: 'fa9' is not one of auto, fa2, fa3"),
], ids=["unknown-arm", "no-arm", "arm-twice", "seed", "warmup", "plan-repeats", "iters", "json-dir", "json-empty",
        "plot-type", "from-json-missing", "sample-huge", "e2e-shape", "rule-json", "flag-and-sweep", "from-json-flags",
        "from-json-measuring", "flush-twice", "e2e-flags", "prefix-kernel"])
def test_usage_errors_exit_2_before_measuring(no_gpu, tmp_path, capsys, args, message):
    """A bad flag is a usage error (exit 2, one line naming the value and the fix), found before the run: not a
    traceback (whose exit 1 would claim an oracle mismatch) nor a failure after the measuring."""
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as info:
        cli.main([a.format(tmp=tmp_path) for a in args])
    assert info.value.code == 2
    err = capsys.readouterr()
    assert message in err.err and "plan (" not in err.out  # (no arm was timed)


@pytest.mark.parametrize("flag,suffix", [("--json", "x.json"), ("--plot", "x.png")])
def test_an_output_folder_that_cannot_hold_the_file_exits_2_before_measuring(no_gpu, tmp_path, capsys, flag, suffix):
    """A path under a regular file (no folder can be made there) was found only when the file was written, after
    the whole run: now a probe is written where the file will go, before anything is measured."""
    pytest.importorskip("matplotlib")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "B-short", flag, str(tmp_path / "a_file" / suffix)])
    assert info.value.code == 2
    err = capsys.readouterr()
    assert f"{flag} {tmp_path / 'a_file' / suffix}: cannot write into" in err.err and "plan (" not in err.out
    assert not any(p.name.startswith(".bsp-probe-") for p in tmp_path.iterdir())


def test_an_existing_folder_that_takes_no_file_exits_2_before_measuring(no_gpu, capsys):
    """``/proc`` exists but takes no new file, even as root (whose permission checks always pass): only writing a
    probe there finds it before the run."""
    if not os.path.isdir("/proc"):
        pytest.skip("needs Linux's /proc")
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "B-short", "--json", "/proc/bsp-x.json"])
    assert info.value.code == 2
    err = capsys.readouterr()
    assert "--json /proc/bsp-x.json: cannot write into /proc" in err.err and "plan (" not in err.out


def test_outputs_through_a_symlink_or_into_a_device_are_judged_where_they_land(no_gpu, tmp_path, capsys):
    """The JSON writer follows a symlink and writes a device in place: the probe judges the link's target's folder
    (a link into /proc is refused before the run) and leaves a device alone (/dev/null passes the check)."""
    if not os.path.isdir("/proc"):
        pytest.skip("needs Linux's /proc")
    link = tmp_path / "out.json"
    link.symlink_to("/proc/bsp-x.json")
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "B-short", "--json", str(link)])
    assert info.value.code == 2 and "cannot write into /proc" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["--preset", "B-short", "--json", "/dev/null"])
    cli._check_outputs(args, cli.build_parser())  # no SystemExit


@pytest.mark.parametrize("name,value,message", [
    ("TLLM_BEAM_SHARED_PREFIX_CHECK", "2", "TLLM_BEAM_SHARED_PREFIX_CHECK='2' is not accepted"),
    ("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", "abc", "TLLM_BEAM_SHARED_PREFIX_MAX_TAIL='abc' is not accepted"),
])
def test_a_bad_library_setting_exits_2_before_measuring(no_gpu, tmp_path, capsys, monkeypatch, name, value, message):
    """A bad setting in the environment made every library arm "skipped" and the run exit 0 (with MAX_TAIL, after a
    line saying the bad value bounds the tails); it is a usage error, as --rule already reported it."""
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "B-short", "--json", str(tmp_path / "x.json")])
    assert info.value.code == 2
    err = capsys.readouterr()
    assert message in err.err and "plan (" not in err.out and "bounds the library" not in err.out
    assert not (tmp_path / "x.json").exists()


def test_check_mode_in_the_environment_is_never_timed(no_gpu, capsys, monkeypatch):
    """TLLM_BEAM_SHARED_PREFIX_CHECK=1 left in a shell made the library arms time check mode (its syncs and oracle,
    10-19x slower on the CPU path) without a word: the timed wrappers are built with check off, and the run says
    so."""
    from beam_shared_prefix import attention

    monkeypatch.setenv("TLLM_BEAM_SHARED_PREFIX_CHECK", "1")
    built = []
    init = attention.BeamSharedPrefixAttention.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self.check)

    monkeypatch.setattr(attention.BeamSharedPrefixAttention, "__init__", spy)
    assert cli.main(["--preset", "B-short", "--arms", "auto"]) == 0
    assert built and not any(built), built
    assert "TLLM_BEAM_SHARED_PREFIX_CHECK is on in this environment; the timed library arms run with check mode off" \
        in capsys.readouterr().out


def test_json_follows_a_symlink_and_never_replaces_a_special_file(no_gpu, tmp_path, capsys):
    """The JSON is written atomically to a regular file (a rename over it); a symlink's target is written, and
    a path that exists but is not a regular file (a device, a pipe) is written in place, never replaced."""
    from microbenchmarks.report import write_json

    target = tmp_path / "target.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    doc = synthetic_doc()
    write_json(doc, str(link))
    assert link.is_symlink() and json.loads(target.read_text())["schema"] == SCHEMA
    write_json(doc, "/dev/null")
    import stat
    import os

    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_json_dash_writes_the_document_alone_to_stdout(no_gpu, tmp_path, capsys, monkeypatch):
    """``--json -``: stdout holds the JSON document and nothing else (a pipe into jq); the table and the log go
    to stderr, and no file named ``-`` appears."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--preset", "B-short", "--sets", "1", "--iters", "2", "--json", "-"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["schema"] == SCHEMA and doc["results"][0]["shape"]["name"] == "B-short-cpu"
    assert "No GPU" in captured.err and "wrote the JSON document to stdout" in captured.err
    assert not (tmp_path / "-").exists()


def test_from_json_merges_one_machines_files_once(tmp_path, capsys):
    """A file named twice counts once; files of different machines are refused (their floors differ)."""
    from microbenchmarks.report import write_json

    doc = synthetic_doc()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_json(doc, str(a))
    out = tmp_path / "merged.json"
    assert cli.main(["--from-json", str(a), "--from-json", str(a), "--json", str(out)]) == 0
    assert len(load_json(str(out))["results"]) == len(doc["results"])
    doc["environment"]["device"] = "another GPU"
    write_json(doc, str(b))
    with pytest.raises(SystemExit) as info:
        cli.main(["--from-json", str(a), "--from-json", str(b)])
    assert info.value.code == 2 and "different machines" in capsys.readouterr().err


def test_auto_arm_runs_on_the_cpu_path(no_gpu, capsys):
    """``--arms auto`` on the CPU path takes the torch tail, as the library's default does there."""
    assert cli.main(["--preset", "B-short", "--arms", "auto", "--sets", "1", "--iters", "1", "--plan-repeats", "0"]) == 0
    assert "library/auto" in capsys.readouterr().out


def test_load_json_refuses_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"schema": "something-else"}')
    with pytest.raises(ValueError, match="schema"):
        load_json(str(p))


def test_module_entry_point_lists_presets(capsys):
    assert cli.main(["--list-presets"]) == 0
    assert "A: 128x96 P3000 T3 16/8 D128 Pg32 bf16" in capsys.readouterr().out


@pytest.mark.parametrize("requests,tail,tail_jitter", [(2, 5, 0.0), (3, 9, 1.0)])  # one tail; tails 1-9
def test_run_point_triton_arms(device, requests, tail, tail_jitter):
    """The library with the fused Triton tail and the tail stage alone, through the benchmark's check.

    On CPU the kernel runs under TRITON_INTERPRET=1 (set by conftest); a tiny shape keeps it fast.
    On a GPU the same arms run for real, captured in CUDA graphs.
    """
    from microbenchmarks.arms import LibraryArm, PrefixStageArm, TailStageArm
    from microbenchmarks.runner import Rates, RunOptions, run_point
    from microbenchmarks.shapes import BenchShape
    from microbenchmarks.workload import build_workload

    shape = BenchShape(requests=requests, beams=3, prompt=37, tail=tail, heads=4, kv_heads=2, head_dim=64,
                       page_size=16, tail_jitter=tail_jitter)
    if tail_jitter:  # both input sets (seeds 0 and 1) must really mix tails
        assert all(len(set(build_workload(shape, seed=s).tail_lens_host)) > 1 for s in (0, 1))
    point = run_point(shape, [LibraryArm("reference"), TailStageArm("triton"), PrefixStageArm("reference"),
                              LibraryArm("triton"), PrefixStageArm("triton"), PrefixStageArm("no-such-backend")],
                      RunOptions(sets=2, iters=1, warmup=0, plan_repeats=2), Rates(), device)
    status = {a["name"]: (a["status"], a.get("reason")) for a in point["arms"]}
    for name in ("library/reference", "tail/triton", "prefix/reference", "library/triton", "prefix/triton"):
        assert status[name] == ("ok", None), (name, status[name])
    assert status["prefix/no-such-backend"][0] == "skipped" and "no prefix backend" in status["prefix/no-such-backend"][1]
    for a in point["arms"][:5]:
        assert a["check"]["ok"] and a["check"]["rows_checked"] == 2 * requests * 3
    assert point["arms"][3]["info"]["backend"] == "triton"
    # The two-launch arm records its tail tiling (few rows here: index blocks); the one-launch cascade has none.
    assert point["arms"][0]["info"]["tail_tiling"]["index_block"] == 32
    assert "tail_tiling" not in point["arms"][3]["info"]
    assert point["tail_lens"]["max"] == tail and (point["tail_lens"]["min"] < tail) == bool(tail_jitter)


def test_arm_list_names():
    from microbenchmarks.arms import default_gpu_arms, parse_arm_list

    names = [a.name for a in parse_arm_list("auto,triton,fa4,prefix,tail")]
    assert names == ["library/auto", "library/triton", "library/fa4", "prefix/flashinfer-auto", "prefix/fa4",
                     "prefix/triton", "tail/triton"]
    assert {"library/auto", "library/triton", "prefix/triton"} <= {a.name for a in default_gpu_arms()}
    shared = parse_arm_list("fa4-shared,flashinfer-shared")
    assert [(a.name, a.backend, a.shared_run) for a in shared] == [
        ("library/fa4+shared-run", "fa4", "on"), ("library/flashinfer+shared-run", "flashinfer", "on")]
    flagged = parse_arm_list("auto,auto-flag,auto-flag-layer")
    assert [(a.name, a.report_errors, a.page_table_audit) for a in flagged] == [
        ("library/auto", False, True), ("library/auto+flag", True, True), ("library/auto+flag-layer", True, False)]
    with pytest.raises(ValueError, match="unknown arm 'fa5'"):
        parse_arm_list("fa5")


def test_report_errors_refuses_the_flag_arm(capsys):
    """``--report-errors`` puts the flag on every library arm: ``auto-flag`` would then time what ``auto`` does."""
    with pytest.raises(SystemExit):
        cli.main(["--preset", "B-short", "--arms", "auto,auto-flag", "--report-errors"])
    assert "auto-flag would time the same wrapper as auto" in capsys.readouterr().err


def test_rule_prints_the_library_verdict_without_measuring(capsys, monkeypatch):
    """``--rule`` answers "is my workload served, and to how many generated tokens?" from the decline rule
    alone: no workload is built and no arm runs."""
    from beam_shared_prefix.decline import max_tail_len
    from microbenchmarks import runner
    from microbenchmarks.shapes import BenchShape

    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("--rule must not measure"))
    argv = ["--preset", "B-medium", "--rule", "--sweep", "beams=2,14", "--sweep", "tail=4,64", "--kv-heads", "2"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    for line, (beams, tail) in zip(lines, [(2, 4), (2, 64), (14, 4), (14, 64)]):
        shape = BenchShape(requests=64, beams=beams, prompt=500, tail=tail, heads=16, kv_heads=2)
        assert f"tails served up to {int(max_tail_len(beams, 500, 2, 64, 16))} generated tokens" in line, line
        reason = runner.decline_reason(shape)
        assert line.endswith("-> serve") if reason is None else line.endswith(f"-> decline: {reason}"), line
    # 14 beams x 64 requests at 2 KV heads (group 8): 896 rows, prompt / 30 = 16 generated tokens.
    assert "tails served up to 16 generated tokens -> serve" in lines[2]
    assert "-> decline: tail 64 generated tokens per beam > 16" in lines[3]
    # From SHARED_RUN_MIN_TAIL generated tokens the default leaves the cascade for a prefix + the shared-run
    # stage + the tail kernel (64 x 30 x 500 at GQA 2 takes the cascade at short tails).
    argv = ["--preset", "B-medium", "--rule", "--sweep", "tail=4,95,96"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" bf16: ", 1)[1].split(",")[0] for line in lines] == [
        "cascade", "cascade", "prefix + tail kernel + shared-run stage"], lines
    # Eager steps take the cascade further than CUDA-graph replays while they are host-bound (64 x 64 x 500:
    # two beam blocks past the 320-token limit of graph replays).
    argv = ["--preset", "B-medium", "--rule", "--beams", "64"]
    assert cli.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert ": cascade (eager; prefix + tail kernel under a CUDA graph), tails served" in line, line
    # GQA 8 at head 128: a CUDA-graph wrapper takes the cascade only with a tail bound (--declare-tail, or
    # TLLM_BEAM_SHARED_PREFIX_MAX_TAIL); an eager step is bounded by its own tail.
    monkeypatch.delenv("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", raising=False)
    argv = ["--preset", "B-medium", "--rule", "--heads", "64", "--requests", "16", "--prompt", "100"]
    for extra, graph_path in (([], " (eager; prefix + tail kernel under a CUDA graph)"), (["--declare-tail"], "")):
        assert cli.main(argv + extra) == 0
        line = capsys.readouterr().out.strip()
        assert f"64/8 D128 Pg32 bf16: cascade{graph_path}, tails served" in line, line


@pytest.mark.parametrize("argv,reason", [
    (["--page-size", "24"], "page size 24 is not one of (16, 32, 64, 128)"),
    (["--page-size", "256"], "page size 256 is not one of (16, 32, 64, 128)"),
    (["--head-dim", "96"], "head_dim=96 is not one of (64, 128, 256)"),
])
def test_rule_and_the_measured_header_apply_the_adapters_gates(capsys, argv, reason):
    """``--rule`` said "serve" at page sizes the adapter's pool gate declines, and the measuring run's header
    (``runner.decline_reason``) gave another reason than ``--rule`` for a head size it declines: both now name the
    gate (preset A is served at its own page and head sizes)."""
    import dataclasses

    from microbenchmarks import runner
    from microbenchmarks.shapes import PRESETS

    assert cli.main(["--preset", "A", "--rule", *argv]) == 0
    assert f"-> decline: {reason}" in capsys.readouterr().out
    field = "page_size" if argv[0] == "--page-size" else "head_dim"
    assert runner.decline_reason(PRESETS["A"]) is None
    assert runner.decline_reason(dataclasses.replace(PRESETS["A"], **{field: int(argv[1])})).startswith(reason)


@pytest.mark.parametrize("graphed", [True, False])
def test_a_graphed_auto_arm_on_another_path_than_the_verdicts_is_named(capsys, monkeypatch, graphed):
    """At 288 requests x 3 beams x 100 tokens, GQA 64/8, ``auto`` takes the cascade on eager steps (which the rule's
    verdict judges) but FA4 + tail on a CUDA-graph wrapper (past the 8-beam tile's cap): a graphed ``library/auto``
    arm timed the latter, and the table's title and the summary line say so; an eager one, or one whose paths agree,
    gets no note."""
    from beam_shared_prefix.prefix import waves
    from microbenchmarks.report import graph_path_note, print_point, print_summary
    from microbenchmarks.runner import rule_paths
    from microbenchmarks.shapes import BenchShape

    monkeypatch.setattr(waves, "multiprocessors", lambda: 132)  # (the cap is 16 programs a multiprocessor)
    monkeypatch.delenv("TLLM_BEAM_SHARED_PREFIX_MAX_TAIL", raising=False)
    shape = BenchShape(name="edge", requests=288, beams=3, prompt=100, tail=4, heads=64, kv_heads=8)
    paths = rule_paths(shape)
    assert paths == {"eager": "cascade", "graph": "prefix + tail kernel"}
    arms = [{"name": "library/auto", "kind": "library", "status": "ok", "graphed": graphed, "time_us": 168.0,
             "speedup_vs_decode": 0.9},
            {"name": "fi-decode-tc", "kind": "baseline", "status": "ok", "time_us": 151.0, "speedup_vs_decode": 1.0}]
    point = {"shape": shape.to_dict(), "label": "edge", "arms": arms, "floors": {}, "decline_reason": None,
             "rule_paths": paths}
    note = graph_path_note(point)
    assert (note is not None) is graphed
    print_point(point, console=None)
    print_summary(make_document([point], {"device": "test"}, {}, {}, ["x"]), console=None)
    out = " ".join(capsys.readouterr().out.split())  # (the table's title wraps)
    if graphed:
        assert "the rule judges the eager path (cascade)" in note and "prefix + tail kernel" in note
        assert out.count(note) == 2, out
    flag_arm = {**arms[0], "name": "library/auto+flag"}
    assert (graph_path_note({**point, "arms": [flag_arm]}) or "").endswith(
        "library/auto+flag ran a CUDA graph, whose path is prefix + tail kernel") is graphed
    assert graph_path_note({**point, "rule_paths": {"eager": "cascade", "graph": "cascade"}}) is None
    assert graph_path_note({**point, "rule_paths": None}) is None


def test_bracketed_text_reaches_the_terminal(capsys):
    """The terminal's console takes no markup: a table title's ``[declined by the rule: ...]`` and a plan line's
    ``[host]`` read as rich style tags otherwise, and vanished from every run's output until round 65."""
    from microbenchmarks.report import print_point

    arms = [{"name": "fi-decode-tc", "kind": "baseline", "status": "ok", "time_us": 151.0, "speedup_vs_decode": 1.0}]
    plan = {"library/auto": {"first_plan_us": 900.0, "replan_us": 9.0, "replan_keyed_us": 4.0,
                             "build_step_plan_us": 200.0}}
    print_point({"shape": {}, "label": "edge", "arms": arms, "floors": {}, "plan": plan,
                 "decline_reason": "64 beam rows < 120: too few programs"}, console=None)
    out = " ".join(capsys.readouterr().out.split())
    assert "[declined by the rule: 64 beam rows < 120: too few programs]" in out, out
    assert "StepPlan build 200 us [host]" in out, out


def test_decline_report_leaves_every_flagged_auto_arm_out():
    """``library/auto+flag`` and ``library/auto+flag-layer`` are auto timed for the flag's cost: neither is the best
    library arm nor the fastest other arm auto is judged against."""
    def arm(name, us):
        return {"name": name, "kind": "library", "status": "ok", "time_us": us, "speedup_vs_decode": 600.0 / us,
                "info": {"backend": "triton"}}

    shape = dict(requests=64, beams=30, prompt=500, tail=4, heads=16, kv_heads=8, head_dim=128)
    doc = make_document([{"shape": shape, "label": "x", "floors": {}, "decline_reason": None,
                          "arms": [arm("library/auto", 60.0), arm("library/auto+flag", 59.0),
                                   arm("library/auto+flag-layer", 58.5)]}], {"device": "test"}, {}, {}, ["x"])
    (row,) = decline_table(doc)
    assert row["best_arm"] == "library/auto" and row["auto_over_best"] is None


def test_from_json_keeps_each_files_rates_and_options(tmp_path):
    """Files of one machine measured at other rates or with other options merge with each point keeping its own
    (the document's are the first file's): a floor is never shown beside a bandwidth it was not computed at."""
    import dataclasses

    from microbenchmarks.arms import default_cpu_arms
    from microbenchmarks.report import write_json
    from microbenchmarks.runner import Rates, RunOptions, run_point
    from microbenchmarks.shapes import BenchShape

    paths = []
    for i, (bandwidth, flush) in enumerate(((4.2e12, "read"), (3.0e12, "none"))):
        opts = RunOptions(sets=1, iters=1, warmup=0, plan_repeats=0, l2_flush=flush)
        rates = Rates(copy_bandwidth=bandwidth, matmul_rate=7e14)
        point = run_point(BenchShape(requests=1, beams=4, prompt=40 + 8 * i, tail=2, name=f"p{i}"),
                          default_cpu_arms()[:1], opts, rates, torch.device("cpu"), log=lambda m: None)
        paths.append(tmp_path / f"{i}.json")
        write_json(make_document([point], {"device": "H100", "gpu": True}, rates.to_dict(), dataclasses.asdict(opts),
                                 ["bench", f"--l2-flush={flush}"]), str(paths[-1]))
    out = tmp_path / "merged.json"
    assert cli.main(["--from-json", str(paths[0]), "--from-json", str(paths[1]), "--json", str(out)]) == 0
    merged = load_json(str(out))
    first, second = merged["results"]
    assert "rates" not in first and merged["options"]["l2_flush"] == "read"
    assert second["options"]["l2_flush"] == "none"
    for point in (first, second):
        bandwidth = (point.get("rates") or merged["rates"])["copy_bandwidth_GBps"] * 1e9
        assert point["floors"]["memory_us"] == pytest.approx(point["traffic_bytes"]["total"] / bandwidth * 1e6)


def test_a_library_auto_arm_that_cannot_plan_fails_the_run(no_gpu, monkeypatch, capsys):
    """What auto serves failing to plan (here out of memory) is a failure (exit 1), not an arm that does not apply."""
    from beam_shared_prefix.attention import BeamSharedPrefixAttention

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(BeamSharedPrefixAttention, "plan", out_of_memory)
    assert cli.main(["--preset", "B-short", "--arms", "auto", "--sets", "1", "--iters", "1", "--plan-repeats",
                     "0"]) == 1
    assert "LIBRARY ARM FAILED: library/auto" in capsys.readouterr().out


def test_a_prefix_arm_must_write_every_rows_lse():
    """The oracle compares the checked rows; an LSE left unwritten (poisoned) on any other row fails the check."""
    from microbenchmarks.arms import Arm, Prepared, RunContext, _step_plan, prefix_backend_class
    from microbenchmarks.check import Oracle, slot_fingerprint
    from microbenchmarks.runner import _check_arm
    from microbenchmarks.shapes import BenchShape
    from microbenchmarks.workload import build_workload

    shape = BenchShape(requests=6, beams=4, prompt=70, tail=3)
    wl = build_workload(shape, "cpu", seed=0, with_baseline_pages=False)
    oracle = Oracle(wl, max_requests=2)
    oracle.precompute()

    class CheckedRowsLseOnly(Arm):
        name, kind, expect, work = "prefix/partial-lse", "stage", "prefix", "prefix"

        def prepare(self, wl, ctx):
            ref = prefix_backend_class("reference")(wl.device, kv_layout=wl.kv_layout)
            ref.plan(_step_plan(wl), shape.heads, shape.kv_heads, shape.head_dim, shape.page_size, wl.dtype)
            out_full = torch.empty_like(wl.q)
            lse_full = torch.empty(ref.lse_shape(wl.num_rows, shape.heads), dtype=torch.float32)
            _, desc = ref.run(wl.q, wl.kv_cache, out_full, lse_full)
            out, lse = torch.empty_like(out_full), torch.empty_like(lse_full)

            def call():
                out.copy_(out_full)
                lse[oracle.rows] = lse_full[oracle.rows]
                return out, type(desc)(lse, desc.layout, desc.base)

            return Prepared(call=call, outputs=lambda r: (r[0], r[1].base2_rows_heads()), poison=[out, lse])

    arm = CheckedRowsLseOnly()
    prepared = arm.prepare(wl, RunContext(device=torch.device("cpu")))
    result, _ = _check_arm(arm, [prepared], [prepared.call], [oracle], wl.dtype, [slot_fingerprint(wl)])
    assert not result["ok"] and "non-finite LSE elements in all rows" in result["message"]


@pytest.mark.parametrize("prompt,page_size,jitter,graph_path", [
    (300, 32, 0.0, "cascade"),  # a 320-token table
    (300, 128, 0.0, "prefix + tail kernel"),  # a 384-token table
    (300, 32, 0.3, "prefix + tail kernel"),  # prompts to 390: a 416-token table
])
def test_the_graph_path_is_judged_at_the_prompt_tables_width(prompt, page_size, jitter, graph_path):
    """A CUDA-graph wrapper picks its path once, at its prompt table's width (the longest prompt drawn, in whole
    pages), not at the mean prompt: rule_verdict's graph path is judged there too (64 x 48, GQA 16/8)."""
    from microbenchmarks.runner import rule_verdict
    from microbenchmarks.shapes import BenchShape

    shape = BenchShape(requests=64, beams=48, prompt=prompt, tail=4, heads=16, kv_heads=8, head_dim=128,
                       page_size=page_size, prompt_jitter=jitter)
    verdict = rule_verdict(shape)
    assert verdict["path"] == "cascade" and verdict["graph_path"] == graph_path


def test_cpu_flag_runs_the_cpu_path_on_a_gpu_machine(monkeypatch):
    """``--cpu`` on a machine with a GPU: the points run on the CPU (the reduced shapes)."""
    from microbenchmarks import runner

    class Ran(Exception):
        pass

    seen = []

    def fake_run_point(shape, arms, opts, rates, device, **kw):
        seen.append((shape.name, str(device)))
        raise Ran

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "run_point", fake_run_point)
    with pytest.raises(Ran):
        cli.main(["--cpu", "--preset", "B-short"])
    assert seen == [("B-short-cpu", "cpu")]
