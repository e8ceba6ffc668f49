"""Where a run's numbers go (jaxlm.metrics): the TensorBoard writer comes without torch, and torch stays importable."""

import subprocess
import sys

SCRIPT = """
import sys
from jaxlm.metrics import MetricsLogger, read_metrics

logger = MetricsLogger(sys.argv[1], total_steps=1, progress=False)
print("torch imported:", "torch" in sys.modules)
logger.log({"step": 1, "loss": 2.5})
logger.close()
print("records:", read_metrics(sys.argv[1] + "/metrics.jsonl"))
try:
    import torch  # noqa: F401
except ImportError as e:
    print("torch:", "not installed" if "No module named" in str(e) else f"broken: {e}")
else:
    print("torch: importable")
"""


def test_the_tensorboard_writer_leaves_torch_out_and_importable(tmp_path):
    """tensorboardX imports torch when it is installed (1.7 s of a run's start); the logger imports it without, and
    afterwards `import torch` works as before (or fails as it would have: not installed)."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "torch imported: False" in lines and "records: [{'step': 1, 'loss': 2.5}]" in lines, proc.stdout
    assert lines[-1] in ("torch: importable", "torch: not installed"), proc.stdout
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
