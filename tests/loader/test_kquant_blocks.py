"""GGUF's Q4_K, Q5_K and Q6_K kept at their own size (loader/kquant_blocks.py, models/kquant.py): the values are
gguf's own dequantization bit for bit at odd shapes, the native converter gives the numpy rule's fields, a real
file's K-quant matrices load to exactly the weights its full dequantization gives, and bad bytes are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from loader_gguf_writing import encode

from tokenriver.errors import ModelLoadError
from tokenriver.loader.gguf_blocks import to_kquant, to_packed
from tokenriver.loader.kquant_blocks import KQUANT_TYPES, unpack_kquant
from tokenriver.loader.load import load_model
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.kquant import KQuantLinear, KQuantRecords
from tokenriver.models.stacked import StackedLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # kquant_files: SmolLM2's K-quant mixes
from kquant_files import LOW_BIT_MIXES, low_bit_file, smollm_kquant_file  # noqa: E402

Q = gguf.GGMLQuantizationType
KINDS = list(KQUANT_TYPES)
has_kquant_kernels = pytest.mark.skipif(
    load_kernels() is None or not load_kernels().kquant, reason="K-quant kernels need AVX512-VNNI"
)


def stored(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return encode((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype, rng)


def bits(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (7, 768), (37, 512)])
def test_values_are_ggufs_dequantization_bit_for_bit(qtype, rows, cols):
    data = stored(qtype, rows, cols, seed=rows)
    reference = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(rows, cols)
    weight = unpack_kquant(data, qtype)
    assert weight.shape == (rows, cols)
    assert np.array_equal(bits(weight.dequantize().numpy()), bits(reference))


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_stored_at_the_files_own_size(qtype):
    """A record takes exactly the file's bytes: the sub-block scales and mins at their own 4 or 6 bits (pack_terms),
    natively and by the numpy rule alike."""
    rows, cols = 48, 1024
    data = stored(qtype, rows, cols)
    for native in (False, True):
        records = to_kquant(data, qtype, native=native)
        assert records.records.nbytes == data.nbytes
    assert torch.equal(records.dequantize(), unpack_kquant(data, qtype).dequantize())


@has_kquant_kernels
@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_the_native_converter_writes_the_numpy_rules_records(qtype):
    data = stored(qtype, 19, 768, seed=3)
    native, rule = to_kquant(data, qtype), to_kquant(data, qtype, native=False)
    assert native.layout == rule.layout
    assert torch.equal(native.records, rule.records) and torch.equal(native.offsets, rule.offsets)


def test_to_packed_keeps_k_quants_only_when_asked():
    data = stored(Q.Q6_K, 4, 256)
    assert isinstance(to_packed(data, Q.Q6_K, kquant=True), KQuantRecords)
    assert not isinstance(to_packed(data, Q.Q6_K), KQuantRecords)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_bytes_that_are_not_whole_super_blocks_are_refused(qtype):
    data = stored(qtype, 2, 256)
    with pytest.raises(ModelLoadError, match=qtype.name):
        unpack_kquant(data[:, :-1], qtype)


@has_kquant_kernels
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q6_K", *LOW_BIT_MIXES])
def test_a_files_k_quant_matrices_load_to_its_dequantized_weights(ftype, tmp_path):
    """Each K-quant layer (fused q/k/v of mixed types included: a stack of parts, each at its own size)
    dequantizes to exactly the float weights the same file loads to with everything dequantized by gguf."""
    path = str(low_bit_file(ftype, tmp_path) if ftype in LOW_BIT_MIXES else smollm_kquant_file(ftype, tmp_path))
    packed = load_model(path, int8_activations=None)
    floats = load_model(path, quantization="none")
    modules = dict(packed.model.named_modules())
    stacked = {name for name, m in modules.items() if isinstance(m, StackedLinear)}
    layers = {
        name: m
        for name, m in modules.items()
        if isinstance(m, (KQuantLinear, StackedLinear)) and name.rsplit(".parts.", 1)[0] not in stacked
    }
    assert layers, "no matrix was kept at its own size"
    assert bool(stacked) == (ftype in LOW_BIT_MIXES)  # their q/k/v mix types; the SmolLM2 files' K-quants do not
    for name, layer in layers.items():
        owner = name.removesuffix(".table")  # a packed embedding's table: the float embedding's weight
        reference = floats.model.get_submodule(owner).weight.detach()
        assert torch.equal(layer.dequantize(), reference), name
    assert any(kind == "K-quant" for kind in packed.bytes_by_format)


def test_the_reference_arithmetic_loads_the_int_layouts(tmp_path):
    """int8_activations=False (exact float32 products, the reference arithmetic) keeps the int4/int8 layouts."""
    loaded = load_model(str(smollm_kquant_file("Q6_K", tmp_path)), int8_activations=False)
    assert not any(isinstance(m, KQuantLinear) for m in loaded.model.modules())
