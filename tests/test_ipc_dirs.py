"""The ipc socket directories of launchers that are gone (SIGKILLed: nothing ran their cleanup) are swept when an
engine starts (`comm/zmq_io.new_ipc_dir`)."""

from __future__ import annotations

import os
import subprocess
import sys

from ringsched.comm.zmq_io import sweep_ipc_dirs


def test_ipc_directories_of_launchers_gone_are_swept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(gone.stdout), os.getpid()
    (tmp_path / f"ringsched-{dead}-0a1b2c-xyz").mkdir()
    (tmp_path / f"ringsched-{dead}-0a1b2c-xyz" / "ctl").touch()  # a socket file the killed launcher left
    (tmp_path / f"ringsched-{alive}-3d4e5f-abc").mkdir()
    (tmp_path / "ringsched-notapid").mkdir()
    assert sweep_ipc_dirs(str(tmp_path)) == [f"ringsched-{dead}-0a1b2c-xyz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ringsched-{alive}-3d4e5f-abc", "ringsched-notapid"]
