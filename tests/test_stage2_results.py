"""The committed device results say what the README says, and say it passed."""
import json
import pathlib

import pytest

from stage2_emulated_exp import results

pytestmark = [pytest.mark.cpu, pytest.mark.stage2]
README = pathlib.Path(results.__file__).with_name("README.md").read_text()


def test_bit_exactness_run_had_no_mismatch_and_enough_inputs():
    doc = results.load(results.BITEXACT)
    assert all(c["mismatches"] == 0 for c in doc["configs"])
    assert all(c["n"] >= 16_000_000 for c in doc["configs"])
    assert {c["degree"] for c in doc["configs"]} == {3, 4, 5}
    assert results.bitexact_summary().startswith("0 mismatching results")


def test_mufu_accuracy_close_to_the_paper():
    doc = json.loads(results.ACCURACY.read_text())
    mufu = doc["rows"]["MUFU.EX2 (measured)"]
    assert mufu["fp32_max"] == pytest.approx(1.41e-7, rel=0.1)
    assert mufu["fp32_mean"] == pytest.approx(3.04e-8, rel=0.1)


def test_readme_throughput_rows_come_from_the_json():
    table = results.throughput_table().splitlines()
    rows = [line for line in table if line.startswith("| ") and "variant" not in line]
    assert rows and all(row in README for row in rows), "README table is stale: rerun python -m stage2_emulated_exp.results"


def test_json_records_device_versions_and_commit():
    doc = results.load(results.THROUGHPUT)
    assert doc["device"].startswith("NVIDIA H100") and doc["cutlass_dsl"] == "4.8.1"
    assert doc["git_commit"][:7].isalnum() and doc["num_sms"] == 132
