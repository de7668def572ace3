"""``import cadence_fx`` enlarges the driver's launch queue unless the user chose its size."""
import os
import subprocess
import sys

import pytest

SHOW = "import cadence_fx, os; print(os.environ.get('CUDA_SCALE_LAUNCH_QUEUES'))"


@pytest.mark.parametrize("given,expected", [(None, "4x"), ("1x", "1x"), ("2x", "2x")])
def test_import_sets_the_launch_queue_scale_unless_it_is_set(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_SCALE_LAUNCH_QUEUES"}
    if given is not None:
        env["CUDA_SCALE_LAUNCH_QUEUES"] = given
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expected


def test_the_scale_is_set_before_torch_is_imported():
    """The driver reads it when CUDA starts: importing cadence_fx must not start torch first."""
    code = ("import sys, cadence_fx, os; "
            "print('torch' in sys.modules, os.environ.get('CUDA_SCALE_LAUNCH_QUEUES'))")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_SCALE_LAUNCH_QUEUES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "4x"]
