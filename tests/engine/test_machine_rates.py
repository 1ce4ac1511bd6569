"""engine/machine_rates.py: the machine's read bandwidth and float32 product rate, measured in well under a second."""

from __future__ import annotations

from tokenriver.engine.machine_rates import measure_machine_rates


def test_both_ceilings_are_measured_quickly_on_the_engines_threads():
    rates = measure_machine_rates("cpu")
    assert rates.device == "cpu" and rates.num_threads >= 1
    # Any machine this runs on reads above 100 MB/s and multiplies above 100 MFLOP/s; the bounds catch a unit slip.
    assert 1e8 < rates.read_bytes_per_second < 1e14
    assert 1e8 < rates.flops_per_second < 1e16
    assert rates.ridge_intensity == rates.flops_per_second / rates.read_bytes_per_second
    assert rates.seconds < 2.0
