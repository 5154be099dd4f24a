"""`parlay run` / `parlay demo` reject bad input before any process starts, naming the fix."""
from __future__ import annotations

import pytest

import parlay.launch
from parlay.cli import main


@pytest.fixture
def launches(monkeypatch):
    """Record launches instead of starting processes; a rejected input must never get here."""
    calls: list[list[str]] = []

    def fake(argv, run_dir, own_id=None):
        calls.append(argv)
        return 0

    monkeypatch.setattr(parlay.launch, "run_torchrun", fake)
    return calls


@pytest.mark.parametrize("args, message", [
    (["run", "-n", "0", "t.py"], r"-n must be >= 1"),
    (["run", "-n", "2", "--ps", "2", "t.py"], r"--ps 2 leaves no worker .* use -n 3"),
    (["run", "-n", "2", "--ps", "-1", "t.py"], r"--ps must be >= 0"),
    (["run", "-n", "3", "--pp", "2", "t.py"], r"multiple of 2 .* got 3\. Hint: -n 4"),
    (["run", "-n", "1", "--pp", "2", "t.py"], r"at least 2 .* got 1\. Hint: -n 2"),
    (["run", "-n", "2", "--pp", "0", "t.py"], r"--pp must be >= 1"),
    (["run", "-n", "2", "--nnodes", "2", "--pp", "3", "--rdzv-endpoint", "h:1", "t.py"],
     r"multiple of 3 .* got 4"),
    (["run", "-n", "2", "--max-restarts", "x", "t.py"], r"--max-restarts must be an integer"),
    (["run", "-n", "2", "--master-port", "70000", "t.py"], r"--master-port must be in 0\.\.65535"),
    (["run", "-n", "1", "--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:1", "t.py"],
     r"--node-rank must be in 0\.\.1, got 5"),
])
def test_run_rejects_bad_launch_options(launches, capsys, args, message):
    with pytest.raises(SystemExit, match=message) as ei:
        main(args)
    assert launches == []
    assert ei.value.code == 2 and "parlay: " in capsys.readouterr().err  # argparse's status


@pytest.mark.parametrize("value", ["soon", "inf", "1e20"])
def test_run_rejects_a_bad_parlay_timeout(launches, monkeypatch, value):
    monkeypatch.setenv("PARLAY_TIMEOUT", value)
    with pytest.raises(SystemExit, match=rf"PARLAY_TIMEOUT must be a positive number .* '{value}'"):
        main(["run", "-n", "2", "t.py"])
    assert launches == []


def test_good_run_reaches_the_launcher(launches):
    assert main(["run", "-n", "4", "--pp", "2", "--max-restarts", "1", "t.py", "--x"]) == 0
    assert main(["run", "-n", "2", "--", "t.py", "--y"]) == 0   # "--" ends parlay's options
    argv, dashed = launches
    assert argv[-2:] == ["t.py", "--x"] and dashed[-2:] == ["t.py", "--y"]
    assert argv[argv.index("--max-restarts") + 1] == "1"


def test_run_m_without_a_module_and_env_with_an_unknown_flag_are_refused(launches, capsys):
    with pytest.raises(SystemExit, match=r"-m needs a module"):
        main(["run", "-n", "1", "-m"])
    with pytest.raises(SystemExit):
        main(["env", "--jsn"])
    assert "unrecognized arguments: --jsn" in capsys.readouterr().err
    assert launches == []


@pytest.mark.parametrize("args, message", [
    # (other tests of the same session may register more modes; they are listed too)
    (["--mode", "bogus"],
     r"--mode must be one of allreduce, diloco, hybrid, ps(, [\w-]+)*, got 'bogus'"),
    (["--compression", "zip"], r"zip"),
    (["--compression", "topk:lots"], r"topk"),
    (["--batch-size", "0"], r"--batch-size must be >= 1, got 0"),
    (["--epochs", "0"], r"--epochs must be >= 1"),
    (["--lr", "0"], r"--lr must be > 0"),
    (["--mode", "ps"], r"--mode ps needs parameter-server ranks\. Hint: add --ps 1"),
    (["--ps", "1", "-n", "3"], r"--ps 1 starts parameter servers, which only --mode ps uses"),
    (["--pp", "2"], r"--pp .* only applies to --mode hybrid"),
    (["--mode", "hybrid", "-n", "3"], r"multiple of 2 .* got -n 3\. Hint: -n 4"),
    (["--mode", "hybrid", "-n", "4", "--pp", "3"], r"multiple of 3"),
    (["--mode", "hybrid", "-n", "4", "--option", "schedule=zigzag"], r"zigzag"),
    (["--mode", "ps", "--ps", "1", "-n", "3", "--option", "consistency=eventually"],
     r"eventually"),
    (["--mode", "hybrid", "-n", "2", "--option", "pp=abc"],
     r"--option pp must be a number of stages >= 1, got 'abc'"),
    # compressions the mode cannot use: each rank refused them after the launch
    (["--mode", "ps", "--ps", "1", "-n", "3", "--compression", "powersgd:4"],
     r"--compression powersgd:4 needs collective rounds"),
    (["--mode", "ps", "--ps", "1", "-n", "3", "--compression", "int8"], r"collective rounds"),
    (["--mode", "ps", "--ps", "1", "-n", "3", "--compression", "auto:candidates=powersgd:4"],
     r"none of \['powersgd:4'\] fits"),
    (["--shard", "optimizer", "--compression", "topk:0.01"], r"needs an element-wise"),
])
def test_demo_rejects_bad_options_before_launch(launches, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["demo", "mnist", *args])
    assert launches == []


def test_demo_argument_errors_come_from_the_demo_parser(launches, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["demo", "mnist", "--epochs", "many"])
    assert ei.value.code == 2
    assert "parlay demo mnist: error: argument --epochs" in capsys.readouterr().err
    assert launches == []


def test_demo_help_shows_the_demos_own_options(launches, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["demo", "mnist", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for option in ("--batch-size", "--compression", "--mode", "--option", "launch options"):
        assert option in out
    assert launches == []


@pytest.mark.parametrize("args", [[], ["--mode", "ps", "--ps", "1", "-n", "3",
                                       "--option", "consistency=stale:2"],
                                  ["--mode", "hybrid", "-n", "4", "--compression", "fp16"],
                                  ["--mode", "ps", "--ps", "1", "-n", "3", "--compression", "auto"],
                                  ["--shard", "gradients", "--compression", "bf16"],
                                  # DiLoCo compresses the outer deltas, not the sharded steps
                                  ["--mode", "diloco", "--shard", "optimizer", "--compression",
                                   "topk:0.01"]])
def test_good_demo_reaches_the_launcher(launches, args):
    assert main(["demo", "mnist", *args]) == 0
    (argv,) = launches
    i = argv.index("-m")
    assert argv[i + 1] == "parlay.demos.mnist"


def test_a_failed_rank_is_told_by_its_own_exit_code_unless_the_launcher_signal_ended_it():
    from types import SimpleNamespace

    from parlay.launch import _how

    def failure(code):
        return SimpleNamespace(exitcode=code, signal_name=lambda: "SIGTERM", error_file_data={
            "message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": ""}}})

    assert _how(failure(1), stopped=False) == "exit code 1: ValueError: boom"
    # the launcher closed it after it had exited by itself: its own exit code stands
    assert _how(failure(1), stopped=True) == "exit code 1: ValueError: boom"
    # the launcher's SIGTERM ended it while it was exiting: the exception alone
    assert _how(failure(-15), stopped=True) == "ValueError: boom"
    assert _how(failure(-15), stopped=False) == "killed by SIGTERM: ValueError: boom"


def test_the_rank_a_comm_error_lost_is_named_first(capsys):
    # Rank 1 ended with sys.exit("...") (no record) and was stopped while exiting; rank 0's
    # CommError was then the only cause named: the line blamed the rank that lost a peer.
    from types import SimpleNamespace

    from parlay.launch import DropPolicy

    def failure(code, message=None):
        data = {"message": {"message": message, "extraInfo": {"py_callstack": ""}}} \
            if message else {}
        return SimpleNamespace(exitcode=code, signal_name=lambda: "SIGTERM",
                               error_file_data=data, local_rank=0)

    policy = DropPolicy("/tmp")
    policy.stopped = {1}
    policy.report({0: failure(1, "CommError: barrier failed on rank 0: rank 1 (its only peer) "
                                 "was lost or did not answer"), 1: failure(-15)}, "the job failed")
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("parlay run: rank 1 failed (killed by SIGTERM, and was lost by the "
                           "others first); rank 0 failed (exit code 1: CommError"), line


def test_ranks_that_failed_alike_are_named_once(capsys):
    # every rank refused the same bad input: one part naming them all, not one per rank
    from types import SimpleNamespace

    from parlay.launch import DropPolicy

    def failure(message):
        return SimpleNamespace(exitcode=1, signal_name=lambda: "", local_rank=0, error_file_data={
            "message": {"message": message, "extraInfo": {"py_callstack": ""}}})

    DropPolicy("/tmp").report({r: failure("ConfigError: batch_size must be > 0")
                               for r in range(4)} | {4: failure("ValueError: other")}, "done")
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == ("parlay run: ranks 0, 1, 2, 3 failed (exit code 1: ConfigError: batch_size "
                    "must be > 0); rank 4 failed (exit code 1: ValueError: other); done"), line


def test_a_droppable_worker_the_launcher_stopped_is_not_reported_lost(tmp_path, capsys):
    # a server died: the launcher stops the workers, which still hold their droppable markers
    from types import SimpleNamespace

    from parlay.launch import DropPolicy, droppable_marker

    policy = DropPolicy(str(tmp_path))
    for r in (1, 2):
        droppable_marker(r, str(tmp_path)).parent.mkdir(exist_ok=True)
        droppable_marker(r, str(tmp_path)).touch()
    policy.stopped = {2}
    failure = SimpleNamespace(exitcode=-15, signal_name=lambda: "SIGTERM", error_file_data={},
                              local_rank=0)
    assert not policy.drop(2, failure) and policy.lost == []
    assert "was lost" not in capsys.readouterr().err
    assert policy.drop(1, failure) and policy.lost == [1]  # one that failed alone still is


def test_demo_help_without_a_name_lists_the_demos(launches, capsys):
    assert main(["demo", "--help"]) == 0  # it required a name: "error: ... required: name"
    assert "demos: mnist" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="name a demo"):
        main(["demo"])
    assert launches == []


def test_demo_json_path_is_checked_before_launch(launches, tmp_path):
    with pytest.raises(SystemExit, match="no writable folder"):  # found after training before
        main(["demo", "mnist", "--json", str(tmp_path / "nope" / "out.json")])
    assert launches == []
