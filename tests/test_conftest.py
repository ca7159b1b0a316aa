"""What tests/conftest.py sets up for the whole run."""

import os
import subprocess
import sys
import tempfile


def test_vllm_usage_stats_are_off_for_the_run_and_its_children():
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
    assert os.environ["DO_NOT_TRACK"] == "1"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['VLLM_NO_USAGE_STATS'], "
                            "os.environ['DO_NOT_TRACK'])"], capture_output=True, text=True, check=True)
    assert child.stdout == "1 1\n"


def test_temp_dirs_in_tmp_path_puts_a_default_run_directory_under_tmp_path(temp_dirs_in_tmp_path):
    made = tempfile.mkdtemp(prefix="octoserve-")  # what start_node does without run_dir
    assert os.path.dirname(made) == str(temp_dirs_in_tmp_path)
    assert os.path.basename(made).startswith("octoserve-")
