"""``import cadence_fx`` leaves the driver's launch queue as it is: the enlarged queue
(``CUDA_SCALE_LAUNCH_QUEUES=4x``) failed the 3-lane Token2Wav captures on the H200."""
import os
import subprocess
import sys

import pytest

SHOW = "import cadence_fx, os; print(os.environ.get('CUDA_SCALE_LAUNCH_QUEUES', 'unset'))"


@pytest.mark.parametrize("given,expected", [(None, "unset"), ("2x", "2x")])
def test_import_leaves_the_launch_queue_scale_alone(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_SCALE_LAUNCH_QUEUES"}
    if given is not None:
        env["CUDA_SCALE_LAUNCH_QUEUES"] = given
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == expected
