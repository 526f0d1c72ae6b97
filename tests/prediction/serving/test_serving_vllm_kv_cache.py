"""vLLM's KV blocks, tokens, concurrency and longest request from the bytes left for them."""

from __future__ import annotations

from _serving_configs import LLAMA_31_8B, MISTRAL_7B_V01, tiny_llama
from hypothesis import given
from hypothesis import strategies as st

from oomkit.prediction.serving import kv_layout, read_serving_model

MiB = 1 << 20
GiB = 1 << 30


def test_llama_31_8b_blocks_of_16_tokens_cost_2_mib(write_config):
    """A page is 16 tokens x 2 x 8 heads x 128 x 2 bytes = 64 KiB a layer; 32 layers: 2 MiB."""
    layout = kv_layout(read_serving_model(write_config(LLAMA_31_8B)), kv_bytes=2, tp=1,
                       block_size=16)
    assert layout.page_size_bytes == 65536 and layout.bytes_per_block == 2 * MiB
    assert layout.num_groups == 1 and layout.group_size == 32
    blocks = layout.num_blocks(int(51.38 * GiB))
    assert blocks == int(51.38 * GiB) // (2 * MiB) == 26306
    assert layout.tokens(blocks) == 26306 * 16 == 420_896
    # cdiv(16000, 16) = 1000 blocks a request: "Maximum concurrency for 16,000 tokens: 26.31x".
    assert layout.max_concurrency(blocks, 16000, 8192) == 26.306
    assert layout.bytes_per_request(16000, 8192) == 1000 * 2 * MiB


def test_longest_request_is_whole_blocks(write_config):
    """With one full-attention group the longest request is the blocks that fit, in tokens."""
    layout = kv_layout(read_serving_model(write_config(LLAMA_31_8B)), kv_bytes=2, tp=1,
                       block_size=16)
    available = int(3.56 * GiB)
    assert layout.longest_request(available, 131072, 2048) == available // (2 * MiB) * 16
    assert layout.longest_request(MiB, 131072, 2048) == 0


def test_sliding_window_requests_need_the_window_not_the_length(write_config):
    """Mistral (all layers slide over 4096): cdiv(min(4095 + 2048, 32768), 16) + 1 blocks."""
    layout = kv_layout(read_serving_model(write_config(MISTRAL_7B_V01)), kv_bytes=2, tp=1,
                       block_size=16)
    assert layout.full_groups == 0 and layout.sliding_window == 4096
    assert layout.blocks_per_request(32768, 2048) == -(-(4095 + 2048) // 16) + 1 == 385


def test_mixed_layers_group_by_the_smaller_kind(write_config):
    """2 full and 10 sliding layers: groups of 2 layers, 1 full group and 5 sliding groups."""
    kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(12)]
    model = read_serving_model(write_config(tiny_llama(num_hidden_layers=12, sliding_window=256,
                                                       layer_types=kinds)))
    layout = kv_layout(model, kv_bytes=2, tp=1, block_size=16)
    assert (layout.group_size, layout.full_groups, layout.num_groups) == (2, 1, 6)
    assert layout.bytes_per_block == layout.page_size_bytes * 2
    # tokens: num_blocks // num_groups * block_size.
    assert layout.tokens(600) == 100 * 16


@given(available=st.integers(0, 200 * GiB), block_size=st.sampled_from([1, 16, 32, 64, 128]))
def test_blocks_use_the_bytes_available_and_no_more(available, block_size):
    """num_blocks * bytes_per_block <= available < (num_blocks + 1) * bytes_per_block."""
    from oomkit.prediction.serving.vllm_kv_cache import KvLayout

    layout = KvLayout(block_size=block_size, page_size_bytes=block_size * 4096, group_size=32,
                      num_groups=1, full_groups=1, sliding_window=None)
    blocks = layout.num_blocks(available)
    assert blocks * layout.bytes_per_block <= available < (blocks + 1) * layout.bytes_per_block
