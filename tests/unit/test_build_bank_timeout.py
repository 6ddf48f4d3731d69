"""build_bank.py creates its process group with bank.dist_timeout_s, as training and evaluation
use theirs (tests/unit/test_process_group_timeout.py; the helper that reads the group back is
shared from there).

    nice -n 15 env OMP_NUM_THREADS=1 python -m pytest tests/unit/test_build_bank_timeout.py -q
"""

from __future__ import annotations

from test_process_group_timeout import ROOT, _group_timeout


def test_build_bank_state_gets_bank_dist_timeout_s(tmp_path):
    # no data at data.dir: the build stops with exit 2 right after creating the group, which is
    # then read back (the default, PyTorch's gloo 1800 s, would read 1800)
    code = f"""
    import sys
    sys.path.insert(0, {str(ROOT)!r})
    import build_bank
    rc = build_bank.main(["--config", {str(ROOT / "configs/tiny.yaml")!r}, "bank.dist_timeout_s=2345",
                          "data.dir={tmp_path}/no_data", "bank.dir={tmp_path}/bank"])
    assert rc == 2, rc
    """
    assert _group_timeout(code, tmp_path) == 2345.0
