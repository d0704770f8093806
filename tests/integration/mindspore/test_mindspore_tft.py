"""MindSpore's TrainFaultTolerance served by mindft: the version gate, and what the served callback
does in a process of its own (the changes are process-wide). Which command mindft-launch runs:
tests/unit/mindspore/test_tft_command.py."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import ROOT, environment, require
from mindft.exitcodes import ExitCode

pytestmark = pytest.mark.compat


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240,
                          cwd=ROOT, env=environment(None, **env))


@pytest.mark.mindspore
def test_only_tested_mindspore_releases_are_served() -> None:
    from mindft.mindspore.mindspore_tft import tested

    assert tested("2.10.0") and tested("2.10.1") and tested("2.10") and tested("2.7.2") and tested("2.9.0")
    assert not tested("2.1.0") and not tested("2.6.0") and not tested("2.11.0") and not tested("2.100.0")


@pytest.mark.mindspore
def test_an_untested_mindspore_stops_the_script_with_one_line_before_it_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    result = _run(f"""
        import sys, mindspore
        mindspore.__version__ = "2.11.0"
        from mindft.mindspore.mindspore_tft import main
        main([{str(script)!r}])
        """, MS_ENABLE_TFT="{TTP:1}")
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "the script ran" not in result.stdout
    error = result.stderr.strip().splitlines()
    assert error == ["mindft: MS_ENABLE_TFT: mindft serves MindSpore's TrainFaultTolerance only on MindSpore 2.7.x, "
                     "2.8.x, 2.9.x, 2.10.x, "
                     "this is 2.11.0; install mindspore==2.10.* or use mindft.mindspore.train"], result.stderr


@pytest.mark.mindspore
def test_a_release_whose_model_train_changed_stops_the_script_with_one_line(tmp_path: Path) -> None:
    # This release's internals match (the compatibility tier checks every supported one); a changed
    # Model.train (a patch release could change it) is refused before the script runs.
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    result = _run(f"""
        from mindspore.train import Model
        from mindft.mindspore.mindspore_tft import internals_changed, main
        assert internals_changed() == "", internals_changed()
        Model.train = lambda self, epoch, train_dataset, callbacks=None: None
        main([{str(script)!r}])
        """, MS_ENABLE_TFT="{TTP:1}")
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "the script ran" not in result.stdout
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("mindft: MS_ENABLE_TFT: mindft cannot serve MindSpore ") and \
        "Model.train takes ('self', 'epoch', 'train_dataset', 'callbacks')" in error[0], result.stderr


@pytest.mark.mindspore
def test_the_served_callback_starts_nothing_of_mindios_and_leaves_the_optimizer_alone(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import mindspore as ms
        from mindspore import nn
        from mindspore.train import TrainFaultTolerance
        ms.set_device("CPU")
        assert TrainFaultTolerance.get_optimizer_wrapper(nn.Adam) is nn.Adam
        callback = TrainFaultTolerance(ckpt_save_path="dumps", initial_step=5)
        assert callback.initial_step == 5 and callback.ckpt_save_path == "dumps"
        try:
            TrainFaultTolerance()
        except ValueError as error:
            print("refused:", error)
        print("served on CPU")
        """))
    result = _run(f"from mindft.mindspore.mindspore_tft import main; main([{str(script)!r}])",
                  MS_ENABLE_TFT="{TTP:1}", MINDFT_BACKEND="mindft")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: TrainFaultTolerance construct need to set ckpt_save_fn or ckpt_save_path!" in result.stdout
    assert "served on CPU" in result.stdout


@pytest.mark.mindspore
def test_on_mindios_backend_mindspores_own_optimizer_wrapper_is_used(tmp_path: Path) -> None:
    require("mindio_ttp", "the mindio_ttp wheel is not installed (pip install ../shared/wheels/mindio_ttp-*.whl)")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import mindspore as ms
        from mindspore import nn
        from mindspore.train import TrainFaultTolerance
        ms.set_device("CPU")
        wrapped = TrainFaultTolerance.get_optimizer_wrapper(nn.Adam)
        print("wrapped:", wrapped is not nn.Adam and issubclass(wrapped, nn.Adam))
        """))
    result = _run(f"from mindft.mindspore.mindspore_tft import main; main([{str(script)!r}])",
                  MS_ENABLE_TFT="{TTP:1}", MINDFT_BACKEND="mindio")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrapped: True" in result.stdout  # MindSpore's own wrapper, for MindIO
