"""benchmarks.sm_clock on CPU: parsing nvidia-smi's samples, means over spans, no nvidia-smi; the
spans benchmarks.ab_fwd.paired_rounds reports; bench_variants' check of --cases."""
import datetime
import random

import pytest

from benchmarks import ab_fwd, bench_variants, sm_clock

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]


def _line(when: datetime.datetime, mhz, watts="250.31") -> str:
    return f"{when.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz}, {watts}"


def test_samples_parse_and_average_over_a_span():
    t = datetime.datetime(2026, 12, 3, 9, 0, 0)
    ms = datetime.timedelta(milliseconds=1)
    text = "\n".join([_line(t, 1980), _line(t + 6 * ms, 1665, "[N/A]"), "garbage, line", _line(t + 12 * ms, 1700),
                      "2026/12/03 09:00:00.0"])       # a partial last line
    samples = sm_clock.parse_samples(text)
    assert [s[1] for s in samples] == [1980.0, 1665.0, 1700.0]
    assert samples[1][2] is None and samples[0][2] == pytest.approx(250.31)
    start = t.timestamp()
    assert sm_clock.mean_in(samples, start, start + 0.007) == pytest.approx((1980 + 1665) / 2)
    assert sm_clock.mean_in(samples, start + 0.005, start + 0.020) == pytest.approx((1665 + 1700) / 2)
    assert sm_clock.mean_in(samples, start + 0.005, start + 0.020, column=2) == pytest.approx(250.31)
    assert sm_clock.mean_in(samples, start + 1, start + 2) is None


def test_no_nvidia_smi_means_no_clock(monkeypatch):
    monkeypatch.setattr(sm_clock.shutil, "which", lambda name: None)
    with sm_clock.ClockLog(0) as clocks:
        pass
    assert clocks.samples == [] and clocks.mean_mhz(0.0, 1e12) is None


def test_paired_rounds_reports_every_timed_span(monkeypatch):
    calls = []
    monkeypatch.setattr(ab_fwd, "time_ms", lambda fn: calls.append(fn()) or 1.0)
    spans = []
    times = ab_fwd.paired_rounds({"a": lambda: "a", "b": lambda: "b"}, 3, random.Random(0), warmup=1, spans=spans)
    assert times == {"a": [1.0] * 3, "b": [1.0] * 3}
    assert sorted((n, r) for n, r, _, _ in spans) == [(n, r) for n in "ab" for r in range(3)]
    assert all(t0 <= t1 for _, _, t0, t1 in spans) and len(calls) == 2 + 6


def test_bench_variants_names_an_unknown_case():
    with pytest.raises(SystemExit, match="--cases: unknown nope"):
        bench_variants.main(["--cases", "causal,nope"])
