"""The GPU's SM clock while a benchmark times, sampled by `nvidia-smi` in the background.

A ratio of two times taken at different SM clocks mixes the kernels' cost with the clock. On an H200
a 40 ms burst of one call ran anywhere from 1665 to 1980 MHz within one paired run, so a ratio of a
short call (a 1024-key window) to a long one (non-causal attention at 16k) moved by 8% with the clock
alone (docs/measurements.md, 2026-12-03, "what a window's whole call times"). `ClockLog` samples
`clocks.sm` every few milliseconds; `mean_mhz(t0, t1)` is the mean over a timed span, and time x
clock (cycles) compares two calls at equal clocks.

    with ClockLog(device_index) as clocks:
        t0 = time.time(); ms = time_ms(fn); t1 = time.time()
    mhz = clocks.mean_mhz(t0, t1)       # after the block; None: no sample in the span, or no nvidia-smi

Sampling is coarse (one reading every ~5-7 ms, an instant each), so a 40 ms span holds 4-8 samples:
good for the median over rounds, not for one round.
"""
from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import tempfile

SAMPLE_MS = 5
FIELDS = "timestamp,clocks.sm,power.draw"


def parse_samples(text: str) -> list[tuple[float, float, float | None]]:
    """(epoch seconds, SM MHz, watts or None) per line of `nvidia-smi --query-gpu=FIELDS --format=csv,
    noheader,nounits`; malformed lines (a partial last line, "[N/A]") are skipped. nvidia-smi writes its
    timestamps in local time, which `datetime.timestamp()` reads as local too."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            mhz = float(parts[1])
        except ValueError:
            continue
        try:
            watts = float(parts[2]) if len(parts) > 2 else None
        except ValueError:
            watts = None
        samples.append((when, mhz, watts))
    return samples


def mean_in(samples, t0: float, t1: float, column: int = 1) -> float | None:
    """Mean of a column (1: MHz, 2: watts) over the samples taken in [t0, t1]; None if there are none."""
    values = [s[column] for s in samples if t0 <= s[0] <= t1 and s[column] is not None]
    return statistics.mean(values) if values else None


class ClockLog:
    """A background `nvidia-smi` writing samples of one GPU to a temporary file (see the module).
    Without nvidia-smi it samples nothing and every mean is None."""

    def __init__(self, device_index: int = 0, sample_ms: int = SAMPLE_MS):
        self.device_index, self.sample_ms = device_index, sample_ms
        self._proc = self._file = None
        self._samples: list | None = None

    def __enter__(self) -> "ClockLog":
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            self._file = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                [exe, f"--id={self._smi_id()}", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                 f"--loop-ms={self.sample_ms}"], stdout=self._file, stderr=subprocess.DEVNULL)
        return self

    def _smi_id(self) -> str:
        """nvidia-smi's name of the CUDA device (its UUID: CUDA and nvidia-smi may number GPUs differently)."""
        import torch

        uuid = str(torch.cuda.get_device_properties(self.device_index).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None
        if self._file is not None:
            self._file.seek(0)
            self._samples = parse_samples(self._file.read())
            self._file.close()
            self._file = None

    @property
    def samples(self) -> list:
        """Every sample, once the sampler has stopped (the child writes at the file's shared offset, so
        the file is read only after it has exited)."""
        if self._proc is not None:
            raise RuntimeError("ClockLog: samples are read after stop() (or the with block)")
        return self._samples or []

    def mean_mhz(self, t0: float, t1: float) -> float | None:
        return mean_in(self.samples, t0, t1)
