import dataclasses

import pytest

from fusionstitching.cost import SPECS, GpuSpec, gpu_spec, spec_key


def test_specs_are_sane():
    for key, spec in SPECS.items():
        assert spec.name == key
        assert spec.warp_size == 32 and spec.max_threads_per_block == 1024
        assert spec.max_warps_per_sm * spec.warp_size == spec.max_threads_per_sm
        assert spec.smem_per_block == 48 * 1024 <= spec.smem_per_block_optin <= spec.smem_per_sm
        assert spec.registers_per_block <= spec.registers_per_sm
        assert 1.0 < spec.clock_ghz < 2.5
        assert 500 < spec.peak_bandwidth_gbs < 10_000
        assert spec.launch_us == 5.0
        assert spec.source


def test_specs_are_the_products():
    assert (SPECS["H100"].sms, SPECS["H100"].peak_bandwidth_gbs) == (132, 3350.0)
    assert (SPECS["H200"].sms, SPECS["H200"].peak_bandwidth_gbs) == (132, 4800.0)
    assert (SPECS["A100"].sms, SPECS["A100"].peak_bandwidth_gbs) == (108, 2039.0)
    assert (SPECS["V100"].sms, SPECS["V100"].peak_bandwidth_gbs) == (80, 900.0)
    assert SPECS["H100"].smem_per_sm == 228 * 1024
    assert SPECS["A100"].smem_per_block_optin == 163 * 1024
    assert SPECS["V100"].smem_reserved_per_block == 0


def test_specs_are_distinct():
    assert len({dataclasses.astuple(spec) for spec in SPECS.values()}) == len(SPECS)
    assert len({spec.peak_bandwidth_gbs for spec in SPECS.values()}) == len(SPECS)


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPECS["H100"].sms = 1


def test_lookup_is_case_insensitive():
    assert gpu_spec("h200") is SPECS["H200"]
    assert gpu_spec("A100") is SPECS["A100"]


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(KeyError, match="known: A100, H100, H200, V100"):
        gpu_spec("MI300")


def test_inconsistent_spec_is_rejected():
    with pytest.raises(ValueError, match="warps"):
        dataclasses.replace(SPECS["H100"], max_warps_per_sm=48)
    with pytest.raises(ValueError, match="opt-in"):
        dataclasses.replace(SPECS["V100"], smem_per_block_optin=200 * 1024)


@pytest.mark.parametrize(
    "device_name, key",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_spec_key_from_device_name(device_name, key):
    assert spec_key(device_name) == key
    if key is not None:
        assert isinstance(gpu_spec(key), GpuSpec)
