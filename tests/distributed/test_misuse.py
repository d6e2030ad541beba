"""Misusing a multi-process job: each mistake ends in an error naming the rule, not a hang.

Issue 34, probed as a user would: a stopped launcher left its ranks running as orphans; a
busy coordinator port gave "Failed to start RPC server" or a crash; an extra step in one
process aborted the finished one while the other reported it "lost"; ``host_values`` (or a
checkpoint ``save``) in one process only waited 120 s; per-process data seeds silently fed
the stages different batches. Session 44: a process that raised while the other waited ended
-6 (jaxlib aborted it in the shutdown barrier the other never reached), and when both raised,
one could be ended as a bystander (75) before printing its own error (CI). The jobs are
``misuse_job.py`` (2 processes x 4 CPU devices), started by ``launch`` with a hard timeout
(children killed by process id).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multimesh_flax import errors
from multimesh_flax.distributed import _sequence, launch

JOB = Path(__file__).with_name("misuse_job.py")
FOUND_BOUND_S = 5.0  # a sequence error is found within the poll interval (0.2 s) plus slack


def _launch(tmp_path: Path, mode: str):
    return launch(
        2,
        [sys.executable, str(JOB), mode, str(tmp_path)],
        devices_per_process=4,
        timeout=120,
        failure_grace=20,
        stream=None,
    )


def _stepped(output: str) -> float:
    return float(re.search(r"stepped at ([0-9.]+)", output).group(1))


@pytest.fixture
def busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_launch_refuses_a_busy_port_naming_it(busy_port):
    with pytest.raises(errors.CoordinatorPortError, match=f"127.0.0.1:{busy_port}"):
        launch(2, [sys.executable, "-c", "pass"], port=busy_port, stream=None)


def test_initialize_names_a_busy_coordinator_port(busy_port):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MMFLAX_COORDINATOR=f"127.0.0.1:{busy_port}")
    env.update(MMFLAX_NUM_PROCESSES="2", MMFLAX_PROCESS_ID="0", MMFLAX_DEVICES_PER_PROCESS="1")
    code = "from multimesh_flax.distributed import initialize; initialize()"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "CoordinatorPortError: Expected a free TCP port" in done.stderr, done.stderr[-2000:]
    assert f"127.0.0.1:{busy_port}" in done.stderr and "Failed to start RPC" not in done.stderr
    assert time.monotonic() - start < 30  # not the other ranks' 60 s initialization timeout


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended; its new parent may not reap it at once


LAUNCHER = """
import sys
from multimesh_flax.distributed import launch
child = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
launch(2, [sys.executable, "-c", child], devices_per_process=1, timeout=120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stopping_the_launcher_ends_every_process():
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
    launchers = [
        subprocess.Popen(
            [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, bufsize=1
        )
        for _ in signals
    ]
    try:
        children = []
        for launcher in launchers:
            pids = []
            while len(pids) < 2:  # the lines "[rank] pid N", as the launcher streams them
                line = launcher.stdout.readline()
                assert line, "the launcher ended before its processes started"
                pids += [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", line.strip())]
            children.append(pids)
        for launcher, sig in zip(launchers, signals, strict=True):
            launcher.send_signal(sig)
        deadline = time.monotonic() + 10
        while any(_alive(p) for pids in children for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {
            sig.name: [p for p in pids if _alive(p)]
            for sig, pids in zip(signals, children, strict=True)
        }
        assert not any(left.values()), f"processes left running: {left}"
        codes = [launcher.wait(timeout=10) for launcher in launchers]
        assert codes == [-s for s in signals]  # each re-delivered once the processes ended
    finally:
        for launcher in launchers:
            launcher.kill()
            launcher.wait(timeout=10)
            launcher.stdout.close()
        for pids in locals().get("children", []):
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_an_extra_step_in_one_process_names_it(tmp_path):
    result = _launch(tmp_path, "extra_step")
    assert result.returncodes == [76, 76] and not result.timed_out
    message = (
        "Process 1 ran call 3 of MPMD program0 (collective call 4) after "
        "process 0 finished after 3 calls"
    )
    for rank in range(2):
        out = result.output(rank)
        assert message in out, out[-3000:]
        assert "ProcessLostError" not in out and "Shutdown barrier" not in out
    assert time.time() - _stepped(result.output(0)) < FOUND_BOUND_S


def test_host_values_in_one_process_names_the_rule(tmp_path):
    result = _launch(tmp_path, "host_values_one")
    assert result.returncodes == [76, 76] and not result.timed_out
    message = "Process 0 ran host_values (collective call 4) after process 1"
    for rank in range(2):
        assert message in result.output(rank), result.output(rank)[-3000:]
    assert time.time() - _stepped(result.output(0)) < FOUND_BOUND_S  # was 120 s


def test_save_in_one_process_names_the_rule(tmp_path):
    result = _launch(tmp_path, "save_one")
    assert result.returncodes == [76, 76] and not result.timed_out
    message = r"Process 0 ran Checkpointer\S* \(collective call 4\) after process 1 finished"
    for rank in range(2):
        assert re.search(message, result.output(rank)), result.output(rank)[-3000:]
    assert time.time() - _stepped(result.output(0)) < FOUND_BOUND_S


@pytest.mark.parametrize("mode", ["seeds", "seeds_late_in_1", "seeds_slow_exit_in_1"])
def test_per_process_batches_fail_at_the_first_step_naming_the_input(tmp_path, mode):
    result = _launch(tmp_path, mode)
    assert result.returncodes == [1, 1] and not result.timed_out
    for rank, other in ((0, 1), (1, 0)):
        out = result.output(rank)
        assert (
            "InputMismatchError: Expected the same value of input 2 (float32[8, 16]; leaf 2" in out
        )
        assert re.search(rf"in process {rank} and float32\[8, 16\]#\w+ in process {other}", out)
        assert "stepped at" not in out


RAISED = {
    "raise_in_0": (0, 1, "RuntimeError: raised in process 0 before step 2"),
    "raise_in_1": (1, 1, "RuntimeError: raised in process 1 before step 2"),
    "interrupt_in_1": (1, -signal.SIGINT, "KeyboardInterrupt"),  # as Python ends on Ctrl-C
}


@pytest.mark.parametrize("mode", RAISED)
def test_a_process_that_raises_keeps_its_status_and_the_waiting_one_names_it(tmp_path, mode):
    failing, status, error = RAISED[mode]
    result = _launch(tmp_path, mode)
    waiting = 1 - failing
    codes = {failing: status, waiting: _sequence.EXIT_PEER_FAILED}
    assert result.returncodes == [codes[0], codes[1]] and not result.timed_out
    assert error in result.output(failing)
    named = (  # its call: 3 (step 2), or 2 if still finishing step 1 when the grace ran out
        rf"ProcessLostError: Process {failing} failed \({re.escape(error)}\) after its "
        rf"collective call 2 \(call 1 of MPMD program0\); process {waiting}, at its call [23] "
        r"\(call [12] of MPMD program0\), stops instead of waiting for it\."
    )
    assert re.search(named, result.output(waiting)), result.output(waiting)[-3000:]
    for rank in range(2):
        assert "Terminating process" not in result.output(rank)  # jaxlib's abort
