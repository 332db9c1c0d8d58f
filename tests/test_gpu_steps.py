"""ci/gpu/run.sh, the GPU machine's entry point: every step it names maps to a function of run.sh or to a step that
the script beside it accepts, so `run.sh --list` and the per-capability scripts cannot drift apart. Runs no real
step: the order of a failing step is checked on stand-in scripts."""
import re
import shutil
import subprocess

from pyllama_moe.paths import CI_DIR

GPU = CI_DIR / "gpu"


def _steps():
    text = (GPU / "run.sh").read_text()
    table = re.search(r"cat <<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    return [line.split(None, 3) for line in table.splitlines()], text


def test_every_step_maps_to_a_script_step_or_a_function_and_is_listed():
    steps, text = _steps()
    names = [s[0] for s in steps]
    assert len(names) == len(set(names))
    for name, target, arg, _ in steps:
        if target.startswith(":"):
            assert re.search(rf"^{target[1:]}\(\) {{", text, re.M), name
            continue
        script = (GPU / target).read_text()
        usage = re.search(r"usage: \S+ ([\w|-]+)", script).group(1).split("|")
        assert arg in usage, (name, target, arg)
        assert re.search(rf"^\s*(\S+\|)*{re.escape(arg)}(\|\S+)*\)$", script, re.M), (name, target, arg)
    listed = subprocess.run(["bash", str(GPU / "run.sh"), "--list"], capture_output=True, text=True, check=True)
    assert [line.split()[0] for line in listed.stdout.splitlines()] == names


def test_an_unknown_step_stops_before_anything_runs():
    r = subprocess.run(["bash", str(GPU / "run.sh"), "build", "no-such-step"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown step no-such-step" in r.stdout


def test_no_script_is_named_after_a_session_or_an_issue():
    names = sorted(p.name for p in GPU.iterdir())
    assert not [n for n in names if re.search(r"issue|^s\d+\.|diag|quick", n)], names


def test_a_failed_step_stops_the_steps_after_it_unless_keep_going(tmp_path):
    # run.sh copied beside stand-ins of common.sh and two step scripts: the identity step fails with 3
    shutil.copy(GPU / "run.sh", tmp_path / "run.sh")
    (tmp_path / "common.sh").write_text(f"T0=$SECONDS\nOUT={tmp_path / 'out'}\n")
    (tmp_path / "prefetch.sh").write_text('echo "ran $1"; [ "$1" = identity ] && exit 3; exit 0\n')
    (tmp_path / "layer-major.sh").write_text('echo "ran $1"\n')

    def run(*steps):
        return subprocess.run(["bash", str(tmp_path / "run.sh"), *steps], capture_output=True, text=True)

    stopped = run("identity", "layer-major-short")
    assert stopped.returncode == 3 and "ran short" not in stopped.stdout
    went_on = run("KEEP_GOING=1", "identity", "layer-major-short")
    assert went_on.returncode == 3 and "ran short" in went_on.stdout
    assert "1 steps passed; failed: identity" in went_on.stdout
    assert run("KEEP_GOING=1", "layer-major-short").returncode == 0
