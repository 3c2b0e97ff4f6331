"""The code reward: a response's program against an item's test cases in every layout verl's
datasets use, run in the sandbox; and the sandbox against programs that attack the host."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.core.safe_regex import RewardError
from services.data.reward.verifiers.code import extract_program, score
from services.data.reward.verifiers.sandbox import UID_SLOTS, Isolation, Killed, SandboxLimits, host_isolation, run

# Tight limits keep the hostile programs' tests short.
LIMITS = SandboxLimits(wall_s=2.0, cpu_s=1, memory_bytes=256 * 2**20, max_processes=8)
ADD = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]}
# The weakest isolation, that of a host where the server is not root: only the audit hook guards.
HOOK_ONLY = Isolation(namespaces=False, uid_base=None, python=sys.executable)


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nIt reads the input and prints the sum."


def test_a_correct_program_scores_one() -> None:
    assert score(fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD, limits=LIMITS) == 1.0


def test_a_partly_correct_program_scores_the_fraction_it_passes() -> None:
    # Wrong on negative numbers only: 2 of 3.
    program = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))"
    assert score(fenced(program), ADD, limits=LIMITS) == pytest.approx(2 / 3)
    assert score(fenced(program), json.dumps(ADD), limits=LIMITS) == pytest.approx(2 / 3)  # the JSON string
    assert score(fenced("print(3)"), ADD, limits=LIMITS) == pytest.approx(1 / 3)


def test_outputs_compare_by_tokens_and_numbers_within_a_tolerance() -> None:
    # Whitespace and line breaks aside; an expected output may be a list of lines (APPS).
    assert score("print('1  2 ')\nprint(3, end='')", {"inputs": [""], "outputs": [["1 2", "3"]]}, limits=LIMITS) == 1.0
    assert score("print(1 / 3)", {"inputs": [""], "outputs": ["0.333333"]}, limits=LIMITS) == 1.0
    assert score("print(0.3334)", {"inputs": [""], "outputs": ["0.333333"]}, limits=LIMITS) == 0.0
    assert score("print('1 2 3 4')", {"inputs": [""], "outputs": ["1 2 3"]}, limits=LIMITS) == 0.0


def test_a_program_that_crashes_after_the_right_output_fails() -> None:
    assert score("print(3)\nraise SystemExit(1)", {"inputs": [""], "outputs": ["3"]}, limits=LIMITS) == 0.0


def test_call_based_cases_in_prime_and_apps_layouts() -> None:
    program = fenced("def add(a, b):\n    return a + b")
    # PRIME: each input is one JSON value per line, each output a JSON string.
    prime = {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2, 3]", '"x"\n"y"'], "outputs": ["3", "[1, 2, 3]", '"xy"']}
    assert score(program, prime, limits=LIMITS) == 1.0
    # APPS: each input a list of arguments, each output wrapped in a list.
    apps = {"fn_name": "add", "inputs": [[1, 2], [0.1, 0.2]], "outputs": [[3], [0.3]]}
    assert score(program, apps, limits=LIMITS) == 1.0
    assert score(program, {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], [5]]}, limits=LIMITS) == 0.5


def test_call_based_cases_find_a_method_of_solution() -> None:
    program = (
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n                return [seen[target - n], i]\n            seen[n] = i"
    )
    tests = {"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6"], "outputs": ["[0, 1]", "[1, 2]"]}
    assert score(fenced(program), tests, limits=LIMITS) == 1.0
    assert score(fenced("class Solution:\n    pass"), tests, limits=LIMITS) == 0.0


def test_assert_cases_as_a_list_and_as_sandbox_fusion_assert_case() -> None:
    program = fenced("def is_even(n):\n    return n % 2 == 0")
    asserts = ["assert is_even(2)", "assert not is_even(3)", "assert is_even(5)"]
    assert score(program, asserts, limits=LIMITS) == pytest.approx(2 / 3)
    assert score(
        program, {"assert_case": asserts, "inputs": ["", "", ""], "outputs": [None, None, None]}, limits=LIMITS
    ) == pytest.approx(2 / 3)
    assert score(program, "assert is_even(4)\nassert not is_even(7)", limits=LIMITS) == 1.0  # one block, not JSON


def test_exiting_early_does_not_skip_the_asserts() -> None:
    assert score(fenced("import sys\nsys.exit(0)"), ["assert False"], limits=LIMITS) == 0.0
    assert score(fenced("import os\nos._exit(0)"), ["assert False"], limits=LIMITS) == 0.0


@pytest.mark.parametrize(
    "tests", [{}, {"inputs": ["1"]}, [], {"inputs": [], "outputs": []}, 42, {"inputs": ["1"], "outputs": []}]
)
def test_test_cases_in_no_known_layout_are_a_reward_error(tests: object) -> None:
    with pytest.raises(RewardError):
        score("print(1)", tests, limits=LIMITS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("print(1)", "print(1)"),  # no fence: the whole response
        ("```python\nx = 1\n```\nthen\n```python\nx = 2\n```", "x = 2\n"),  # the last block
        ("```python\nx = 1\n```\nOutput:\n```\n1\n```", "x = 1\n"),  # a python block before an untagged one
        ("```\nx = 3\n```", "x = 3\n"),  # untagged only
        ("```Python3\nx = 4\n```", "x = 4\n"),
        ("```python\nx = 5\nprint(x)", "x = 5\nprint(x)"),  # a response cut before its closing fence
    ],
)
def test_extract_program(response: str, program: str) -> None:
    assert extract_program(response) == program


# Hostile programs: each fails its test case and leaves the host as it was.


def sandbox_processes() -> list[str]:
    """Live processes whose working directory is a sandbox run's, or whose uid is a sandbox uid."""
    uid_base = host_isolation().uid_base
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        in_sandbox = "spotrl-sandbox-" in cwd or (uid_base is not None and uid_base <= uid <= uid_base + UID_SLOTS)
        if in_sandbox and fields["State"].split()[0] != "Z":
            found.append(f"{pid} {cwd} uid {uid}")
    return found


def test_a_fork_bomb_is_bounded_and_leaves_no_process() -> None:
    """Under the run's own uid, RLIMIT_NPROC stops the bomb (it is not enforced for root, so the
    hook-only isolation of a root server is not tried here: nothing would bound it but the clock)."""
    bomb = "import os\nwhile True:\n    os.fork()"
    started = time.monotonic()
    assert score(bomb, {"inputs": [""], "outputs": ["1"]}, limits=LIMITS) == 0.0
    assert not run(bomb, "", LIMITS).ok
    assert time.monotonic() - started < 2 * LIMITS.wall_s + 3.0
    deadline = time.monotonic() + 1.0
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_an_endless_loop_is_killed() -> None:
    started = time.monotonic()
    result = run("while True:\n    pass", "", LIMITS)
    assert result.killed in (Killed.CPU, Killed.TIMEOUT) and result.exit_code != 0
    assert time.monotonic() - started < LIMITS.wall_s + 2.0
    assert score("x = 0\nwhile True:\n    x += 1", {"inputs": [""], "outputs": ["1"]}, limits=LIMITS) == 0.0
    # Using no CPU, it is ended by the wall clock.
    assert run("import time\ntime.sleep(60)", "", SandboxLimits(wall_s=0.5)).killed is Killed.TIMEOUT


def test_a_huge_allocation_fails() -> None:
    program = "data = bytearray(10 * 2**30)\nprint('allocated')"
    assert score(program, {"inputs": [""], "outputs": ["allocated"]}, limits=LIMITS) == 0.0
    assert run(program, "", LIMITS).killed is Killed.MEMORY


@pytest.mark.parametrize("isolation", [None, HOOK_ONLY], ids=["host", "hook only"])
def test_a_program_cannot_write_outside_its_directory(tmp_path: Path, isolation: Isolation | None) -> None:
    target = tmp_path / "escaped.txt"
    program = f"open({str(target)!r}, 'w').write('pwned')\nprint('written')"
    result = run(program, "", LIMITS, isolation=isolation)
    assert "written" not in result.stdout and not target.exists()
    # Its own directory is writable.
    assert (
        run(
            "open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())", "", LIMITS, isolation=isolation
        ).stdout
        == "ok\n"
    )


@pytest.mark.parametrize("isolation", [None, HOOK_ONLY], ids=["host", "hook only"])
def test_the_server_environment_does_not_reach_a_program(
    monkeypatch: pytest.MonkeyPatch, isolation: Isolation | None
) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SPOTRL_TEST_SECRET", secret)
    program = "import os\nprint(os.environ.get('SPOTRL_TEST_SECRET', 'none'))"
    assert score(program, {"inputs": [""], "outputs": [secret]}, limits=LIMITS) == 0.0
    for program in [
        "import os\nprint(dict(os.environ))",
        # The environment of the server's process itself, and of the launcher, its child.
        (
            f"import os\nfor pid in ({os.getpid()}, os.getppid()):\n    try:\n        print(open(f'/proc/{{pid}}/environ').read())\n"
            "    except OSError as e:\n        print(e)"
        ),
    ]:
        result = run(program, "", LIMITS, isolation=isolation)
        assert secret not in result.stdout and secret not in result.stderr


@pytest.mark.parametrize("isolation", [None, HOOK_ONLY], ids=["host", "hook only"])
def test_a_program_cannot_connect_to_a_listening_port(isolation: Isolation | None) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')\nprint('connected')"
        assert score(program, {"inputs": [""], "outputs": ["connected"]}, limits=LIMITS) == 0.0
        result = run(program, "", LIMITS, isolation=isolation)
        assert "connected" not in result.stdout
        # No connection is waiting to be accepted.
        assert select.select([server], [], [], 0.2)[0] == []
