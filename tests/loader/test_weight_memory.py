"""Weights moved into one huge-page mapping after a load: the same values, tied tensors still one copy, kernels
bound to the new addresses, and a mapping the kernel may back with 2 MiB pages."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from loader_gguf_writing import tiny_llama_tensors, write_gguf

from tokenriver.errors import ModelLoadError
from tokenriver.kv.cache import KVCache
from tokenriver.loader import weight_memory
from tokenriver.loader.assemble import build_model
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.load import load_model
from tokenriver.loader.weight_memory import huge_pages_available, move_weights_to_huge_pages
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.quant import Int4Linear, Int8Linear
from tokenriver.process_memory import resident_bytes

Q = gguf.GGMLQuantizationType
IDS = [3, 17, 5, 29, 11, 0, 8, 21, 13, 2, 30, 7]
# A Q4_K_M file's mix: q/k at 4 bits and v at 6 (a fused projection of two formats), a tied Q8_0 embedding.
TYPES = [Q.Q8_0, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_0, Q.Q5_0, Q.Q6_K]

# A 32-token SentencePiece vocabulary (the tiny model's size), so that load_model can read the file.
_PIECES = ["<unk>", "<s>", "</s>", "▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁a", "▁b"]
VOCABULARY = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": _PIECES,
    "tokenizer.ggml.scores": [-float(i) for i in range(len(_PIECES))],
    "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (len(_PIECES) - 3),
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}

pytestmark = pytest.mark.skipif(not huge_pages_available(), reason="this platform has no transparent huge pages")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("weights") / "tiny.gguf")
    rng = np.random.default_rng(7)
    write_gguf(path, tiny_llama_tensors(TYPES, rng), rng=rng, extra=VOCABULARY)
    return path


def _logits(model: torch.nn.Module) -> torch.Tensor:
    config = model.config
    cache = KVCache(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = AttentionMetadata.build([len(IDS)], [len(IDS)], [[0]], 16)
    with torch.no_grad():
        hidden = model(torch.tensor(IDS), torch.arange(len(IDS)), cache, metadata)  # [T, hidden]
        return model.compute_logits(hidden)  # [T, vocab]


@pytest.mark.parametrize("int8_activations", [False, True])
def test_moved_weights_compute_the_same_logits_through_rebound_kernels(tiny_file, int8_activations):
    checkpoint = read_gguf(tiny_file, keep_quantized=True)
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", tiny_file, "auto")
    del checkpoint
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert layers and all(layer.backend == "native" for layer in layers)
    for layer in layers:
        layer.set_int8_activations(int8_activations)
    before = _logits(model)
    # Single rows take the decode GEMV, all rows the GEMM: both kernels must see the new addresses.
    first_row_before = model.compute_logits(model(torch.tensor(IDS[:1]), torch.arange(1), *_one_token_cache(model)))

    moved = move_weights_to_huge_pages(model)

    tensors = [*model.parameters(), *model.buffers()]
    assert {t.untyped_storage().data_ptr() for t in tensors} == {tensors[0].untyped_storage().data_ptr()}
    assert moved == tensors[0].untyped_storage().nbytes()
    assert moved >= sum(t.numel() * t.element_size() for t in tensors)
    assert all(layer.int8_activations == int8_activations for layer in layers)
    assert torch.equal(_logits(model), before)
    first_row_after = model.compute_logits(model(torch.tensor(IDS[:1]), torch.arange(1), *_one_token_cache(model)))
    assert torch.equal(first_row_after, first_row_before)


def _one_token_cache(model: torch.nn.Module) -> tuple[KVCache, AttentionMetadata]:
    config = model.config
    return (
        KVCache(config.num_layers, 1, 16, config.num_kv_heads, config.head_dim, torch.float32),
        AttentionMetadata.build([1], [1], [[0]], 16),
    )


def test_a_tied_embedding_stays_one_copy(tiny_file):
    model = load_model(tiny_file).model
    assert model.model.embed_tokens.table is model.lm_head
    packed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert len(packed) == 1


def test_the_mapping_asks_for_huge_pages():
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    smaps = Path("/proc/self/smaps")
    if not setting.exists() or not smaps.exists() or "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    module = torch.nn.Linear(1024, 2048)  # 8 MiB of weights: several whole 2 MiB pages
    weight = module.weight.detach().clone()
    move_weights_to_huge_pages(module)
    assert torch.equal(module.weight, weight)
    assert _smaps_field(smaps.read_text(), module.weight.data_ptr(), "THPeligible") == 1


def _smaps_field(text: str, address: int, field: str) -> int:
    inside = False
    for line in text.splitlines():
        mapping = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if mapping:
            inside = int(mapping.group(1), 16) <= address < int(mapping.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for address {address:#x}")


def test_the_move_on_a_second_thread_ends_with_the_block_and_keeps_the_thread_count():
    module = torch.nn.Linear(256, 512)
    weight = module.weight.detach().clone()
    address = module.weight.data_ptr()
    threads = torch.get_num_threads()
    with weight_memory.moving_to_huge_pages(module):
        pass
    assert module.weight.data_ptr() != address and torch.equal(module.weight, weight)
    assert torch.get_num_threads() == threads


def test_an_error_of_the_move_is_raised_in_the_callers_thread(monkeypatch):
    def fail(model):
        raise MemoryError("no memory for the mapping")

    monkeypatch.setattr(weight_memory, "move_weights_to_huge_pages", fail)
    with pytest.raises(MemoryError, match="no memory for the mapping"):
        with weight_memory.moving_to_huge_pages(torch.nn.Linear(4, 4)):
            pass


def test_without_huge_pages_from_the_kernel_the_weights_stay(monkeypatch):
    class NoHugePages:
        def __init__(self, *args, **kwargs):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(weight_memory.mmap, "mmap", NoHugePages)
    module = torch.nn.Linear(64, 32)
    address = module.weight.data_ptr()
    assert weight_memory.move_weights_to_huge_pages(module) == 0
    assert module.weight.data_ptr() == address


def _mapping_rss_kib(address: int) -> int:
    return _smaps_field(Path("/proc/self/smaps").read_text(), address, "Rss")


def test_a_load_makes_the_kept_packed_weights_in_the_arena_and_fuses_into_it(tiny_file):
    arena = weight_memory.WeightArena(64 * 2**20)
    checkpoint = read_gguf(tiny_file, keep_quantized=True, empty=arena.empty)
    in_arena = {
        name
        for name, weight in checkpoint.weights.items()
        if not isinstance(weight, torch.Tensor) and arena.holds(weight.qweight)
    }
    # q/k (Q4_K) and v (Q6_K) meet as int8 when fused: copied again, so they are made elsewhere. gate (Q4_0) and
    # up (Q5_0) are both int4: converted straight into their rows of the fused projection.
    assert "model.layers.0.self_attn.o_proj.weight" in in_arena
    assert not any(part in name for name in in_arena for part in ("q_proj", "k_proj", "v_proj"))
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= in_arena
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", tiny_file, "auto", empty=arena.empty)
    assert arena.holds(model.model.layers[0].self_attn.qkv_proj.qweight)
    assert arena.holds(model.model.layers[0].mlp.gate_up_proj.qweight)
    reference_checkpoint = read_gguf(tiny_file, keep_quantized=True)
    reference = build_model(reference_checkpoint.config, reference_checkpoint.weights, "cpu", tiny_file, "auto")
    assert torch.equal(_logits(model), _logits(reference))

    assert arena.adopt(model)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(arena.holds(t) for t in tensors)
    assert torch.equal(_logits(model), _logits(reference))
    arena.close()


def test_parts_of_one_format_are_converted_into_their_rows_of_the_fused_projection(tmp_path):
    path = str(tmp_path / "one_format.gguf")
    rng = np.random.default_rng(3)
    # q/k/v all Q4_K (int4), gate and up Q5_0 (int4 with fifth bits): each fused projection has one packed format.
    write_gguf(
        path,
        tiny_llama_tensors([Q.Q8_0, Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q4_K, Q.Q5_0, Q.Q5_0, Q.Q4_K], rng),
        rng=rng,
        extra=VOCABULARY,
    )
    arena = weight_memory.WeightArena(64 * 2**20)
    checkpoint = read_gguf(path, keep_quantized=True, empty=arena.empty)
    layer = "model.layers.0"
    q, k, v = (checkpoint.weights[f"{layer}.self_attn.{part}_proj.weight"] for part in "qkv")
    gate, up = (checkpoint.weights[f"{layer}.mlp.{part}_proj.weight"] for part in ("gate", "up"))
    assert gate.high_bits is not None and q.high_bits is None
    for before, after in ((q, k), (k, v), (gate, up)):
        for field in ("qweight", "scales", "mins") + (("high_bits",) if before is gate else ()):
            first, second = getattr(before, field), getattr(after, field)
            assert arena.holds(first) and second.data_ptr() == first.data_ptr() + first.numel() * first.element_size()
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", path, "auto", empty=arena.empty)
    assert model.model.layers[0].self_attn.qkv_proj.qweight.data_ptr() == q.qweight.data_ptr()  # no copy
    assert model.model.layers[0].mlp.gate_up_proj.qweight.data_ptr() == gate.qweight.data_ptr()
    reference_checkpoint = read_gguf(path, keep_quantized=True)
    reference = build_model(reference_checkpoint.config, reference_checkpoint.weights, "cpu", path, "auto")
    assert torch.equal(_logits(model), _logits(reference))
    arena.close()


def test_an_arena_full_or_closed_makes_tensors_in_ordinary_memory():
    arena = weight_memory.WeightArena(4096)
    inside = arena.empty((24, 32), torch.float32)  # 3 KiB
    outside = arena.empty((24, 32), torch.float32)  # past the capacity
    assert arena.holds(inside) and not arena.holds(outside)
    assert inside.shape == outside.shape == (24, 32) and inside.is_contiguous()
    arena.close()
    assert not arena.holds(arena.empty((2,), torch.int8))


def test_weights_that_do_not_fit_move_to_a_mapping_of_their_own():
    module = torch.nn.Linear(64, 32)
    weight = module.weight.detach().clone()
    arena = weight_memory.WeightArena(4096)  # less than the 8 KiB weight
    assert not arena.adopt(module)
    with weight_memory.moving_to_huge_pages(module, arena):
        pass
    assert not arena.holds(module.weight) and torch.equal(module.weight, weight)
    assert module.weight.untyped_storage().data_ptr() == module.bias.untyped_storage().data_ptr()


def test_pages_are_faulted_in_ahead_of_the_tensors_and_handed_back_at_close():
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps to read a mapping's resident size from")
    arena = weight_memory.WeightArena(256 * 2**20, populate=True)
    tensor = arena.empty((2**20,), torch.uint8)
    for _ in range(500):  # up to 5 s for the faulting thread to get ahead of the 1 MiB tensor
        if _mapping_rss_kib(tensor.data_ptr()) >= 32 * 1024:
            break
        time.sleep(0.01)
    assert _mapping_rss_kib(tensor.data_ptr()) >= 32 * 1024
    tensor.fill_(7)
    arena.close()
    assert _mapping_rss_kib(tensor.data_ptr()) <= 2 * 1024  # the page that holds the tensor
    assert torch.all(tensor == 7)


def test_a_load_that_fails_stops_the_faulting_thread(tmp_path):
    path = str(tmp_path / "q8_1.gguf")
    tensors = tiny_llama_tensors([Q.F32] * 8, np.random.default_rng(0))
    tensors["blk.0.ffn_up.weight"] = (tensors["blk.0.ffn_up.weight"][0], Q.Q8_1)  # a type no rule converts
    write_gguf(path, tensors, extra=VOCABULARY)
    with pytest.raises(ModelLoadError, match="Q8_1"):
        load_model(path)
    assert not [thread for thread in threading.enumerate() if thread.name == "tokenriver-weight-pages"]


@pytest.mark.parametrize("quantization", ["auto", "int8", "int4", "none"])
def test_the_arena_holds_only_the_weights_the_model_keeps(tiny_file, monkeypatch, quantization):
    # "int8"/"int4" quantize again what the reader made: had the reader made it in the arena, it would stay there.
    arenas: list[weight_memory.WeightArena] = []
    made = weight_memory.WeightArena.__init__

    def recording(self, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        arenas.append(self)

    monkeypatch.setattr(weight_memory.WeightArena, "__init__", recording)
    model = load_model(tiny_file, quantization=quantization).model
    (arena,) = arenas
    tensors = {
        t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(): t.numel() * t.element_size()
        for t in (*model.parameters(), *model.buffers())
    }
    assert all(arena.holds(t) for t in (*model.parameters(), *model.buffers()))
    assert arena.used <= sum(tensors.values()) + 64 * len(tensors)  # each tensor aligned to 64 bytes, nothing more


def test_pages_are_faulted_in_ahead_no_further_than_the_limit():
    """The loader limits the faulting thread to the bytes the weights will at least take (load.py), so that it
    faults in no page the weights then leave empty."""
    arena = weight_memory.WeightArena(256 * 2**20, populate=True, populate_limit=3 * 2**20)
    tensor = arena.empty((2**20,), torch.uint8)
    time.sleep(0.2)  # time for the faulting thread to run ahead, were it not held back
    resident = resident_bytes([(arena.storage.data_ptr(), arena.capacity)])
    arena.close()
    assert resident is None or resident <= 4 * 2**20  # the limit, rounded up to whole 2 MiB pages
    del tensor
