"""The paged KV cache: block allocation, prefix caching, per-step inputs, the ``pb_kv::paged_attention`` splitting op and the indexed (sparse) attention ops."""

from ..attention.kernels import attend  # the reference kernel, documented under kv too
from .cache import BLOCK_TABLES, POSITIONS, REQUEST_INDEX, SLOT_MAPPING, BlockAllocator, PagedKVCache
from .indexed import attend_selected, index_topk, indexed_attention, indexer_topk, write_index_keys
from .prefix_cache import PrefixCache, block_keys, salt_bytes
from .op import PAD_SLOT, PagedAttentionMetadata, current_metadata, paged_attention, write_kv

__all__ = [
    "attend",
    "BLOCK_TABLES", "POSITIONS", "REQUEST_INDEX", "SLOT_MAPPING", "BlockAllocator", "PagedKVCache",
    "attend_selected", "index_topk", "indexed_attention", "indexer_topk", "write_index_keys",
    "PrefixCache", "block_keys", "salt_bytes",
    "PAD_SLOT", "PagedAttentionMetadata", "current_metadata", "paged_attention", "write_kv",
]
